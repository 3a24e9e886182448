"""Built-in environments. Each subpackage registers itself with ``@agentrl.environment``."""
