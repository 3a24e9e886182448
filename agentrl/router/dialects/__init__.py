"""The wire protocols the router speaks, one dialect module each, over the one capture path.

A dialect translates its API's requests into the capture core's call (a chat body for
:meth:`~agentrl.router.core.Router.chat`, a completion body for :meth:`~agentrl.router.core.Router.complete`)
and the core's answer back, and owns its routes, its streaming and its error shape. Its interface is
one function, ``add_routes(app)``, which the app (:mod:`agentrl.router.server`) calls; what the routes
share (auth, session lookup, JSON bodies, the two event-stream framings) is :mod:`agentrl.router.http`.

- ``chat``: OpenAI Chat Completions (``/v1/chat/completions``), the core's own shape.
- ``completions``: OpenAI text Completions (``/v1/completions``).
- ``responses``: the OpenAI Responses API (translation in ``responses_translate``, typed events in
  ``responses_stream``).
- ``messages``: the Anthropic Messages API, with Anthropic's error shape on its routes.

Invariant: the capture core (every ``agentrl.router`` module but the app, ``http`` and this package)
imports no dialect; nothing is imported here.
"""
