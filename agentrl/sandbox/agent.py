"""The in-sandbox exec agent: a small stdlib-only server that runs inside every sandbox.

Role: the host starts it as the sandbox's main process (``python3 -u -c <this file's source>``) and
talks to it over the process's stdin/stdout, so a tool call costs one round trip on an already open
pipe instead of a ``docker exec`` (which creates a process through the engine, about 70 ms).

Wire format, both directions: a 4-byte big-endian length, then that many bytes holding the ``repr``
of a dict of str/bytes/int/float/bool/None/list values, parsed with ``ast.literal_eval`` (safe,
and unlike json it is in python3-minimal; bytes need no base64).
Requests carry ``id`` and ``op``; every request gets exactly one response with the same ``id``.
Requests are served concurrently (one thread each), except ``reset`` which runs alone.

Invariants:
- Only the agent writes to its stdout; commands get their own pipes.
- A command runs in its own session/process group; at its timeout the whole group is SIGKILLed.
- Commands get ``oom_score_adj`` 1000 so that the kernel's OOM killer picks them, not the agent.
- ``reset`` kills every process except the agent and its ancestors (the container's init) and
  empties the writable directories; it answers ``ok: false`` if it could not do both.
- This file must run on the image's ``python3`` (3.9+) with only what python3-minimal ships (no
  json, no shutil), and must not import anything from agentrl.
"""

import ast
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time

WRITABLE_DIRS = ("/work", "/tmp", "/dev/shm")
_out = sys.stdout.buffer
_out_lock = threading.Lock()
_active = 0  # requests in flight; reset waits for zero
_active_cond = threading.Condition()
_background = {}  # pid -> Popen


def _send(msg):
    data = repr(msg).encode()
    with _out_lock:
        _out.write(struct.pack(">I", len(data)) + data)
        _out.flush()


def _read_exact(stream, n):
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _oom_kills():
    path = os.environ.get("AGENTRL_OOM_FILE")
    candidates = [path] if path else [
        "/sys/fs/cgroup/memory/memory.oom_control",  # cgroup v1
        "/sys/fs/cgroup/memory.events",  # cgroup v2
    ]
    for candidate in candidates:
        try:
            with open(candidate) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            continue
    return None


def _child_setup():
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)


def _argv(req):
    cmd = req.get("cmd")
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def _env(req):
    env = dict(os.environ)
    env.pop("AGENTRL_OOM_FILE", None)
    env.update(req.get("env") or {})
    return env


def _collect(proc, timeout, limit, stdin_data):
    """Feed stdin, read stdout/stderr (each capped at `limit`) and wait for the command, in this
    thread alone: a fork bomb may leave no pids for helper threads. When the command exits, its
    group is killed so that leftover children release the pipes; at the deadline, likewise."""
    deadline = None if timeout is None else time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    fds = {proc.stdout.fileno(): 0, proc.stderr.fileno(): 1}
    bufs, totals = [[], []], [0, 0]
    for fd in fds:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin_data) if stdin_data is not None else None
    if pending is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    pidfd = None
    try:
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pass  # no pidfd: poll for the exit instead
    timed_out = False
    drain_until = None
    try:
        while True:
            now = time.monotonic()
            if drain_until is None and proc.poll() is not None:
                if not fds:
                    break
                _kill_group(proc.pid)  # exited: its leftover children must let go of the pipes
                drain_until = now + 1.0
            if drain_until is not None and not fds:
                break
            if deadline is not None and now >= deadline and not timed_out and drain_until is None:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
                continue
            if drain_until is not None and now >= drain_until:
                break  # something outside the group holds the pipes; stop reading
            waits = [t - now for t in (deadline, drain_until) if t is not None]
            if pidfd is None and drain_until is None:
                waits.append(0.005)
            for key, _ in sel.select(max(0.0, min(waits)) if waits else None):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    continue
                if pending is not None and fd == proc.stdin.fileno():
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except OSError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                        pending = None
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    del fds[fd]
                    continue
                i = fds[fd]
                if totals[i] < limit:
                    bufs[i].append(chunk[: limit - totals[i]])
                totals[i] += len(chunk)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
    return (b"".join(bufs[0]), b"".join(bufs[1])), timed_out


def _kill_group(pgid):
    for _ in range(50):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.002)


def op_exec(req):
    limit = int(req.get("max_output", 1 << 20))
    timeout = req.get("timeout")
    stdin_data = req.get("stdin")
    oom_before = _oom_kills()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            _argv(req), cwd=req.get("cwd") or "/work", env=_env(req), start_new_session=True,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_child_setup, close_fds=True,
        )
    except OSError as e:
        # Command not found, fork refused (pids limit), ...: a tool failure, reported like a shell would.
        code = 127 if isinstance(e, FileNotFoundError) else 126
        return {"exit_code": code, "stdout": "", "stderr": f"{type(e).__name__}: {e}\n",
                "timed_out": False, "oom_killed": False, "duration_s": time.monotonic() - start}
    out, timed_out = _collect(proc, timeout, limit, stdin_data)
    code = proc.returncode
    exit_code = 128 - code if code < 0 else code
    oom = False
    if code == -signal.SIGKILL and not timed_out:
        oom_after = _oom_kills()
        oom = oom_after is None or oom_before is None or oom_after > oom_before
    return {
        "exit_code": 124 if timed_out else exit_code,
        "stdout": out[0].decode("utf-8", "replace"),
        "stderr": out[1].decode("utf-8", "replace"),
        "timed_out": timed_out, "oom_killed": oom, "duration_s": time.monotonic() - start,
    }


def op_write(req):
    path = req["path"]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "wb") as f:
        f.write(req["data"])
    if req.get("mode") is not None:
        os.chmod(path, int(req["mode"]))
    return {}


def op_read(req):
    with open(req["path"], "rb") as f:
        data = f.read(int(req.get("max_bytes", 64 << 20)))
    return {"data": data}


def op_bg_start(req):
    log_dir = "/tmp/.agentrl"
    os.makedirs(log_dir, exist_ok=True)
    log_path = f"{log_dir}/bg-{len(_background) + 1}.log"
    log = open(log_path, "wb")
    try:
        proc = subprocess.Popen(
            _argv(req), cwd=req.get("cwd") or "/work", env=_env(req), start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_child_setup,
        )
    finally:
        log.close()
    _background[proc.pid] = proc
    return {"pid": proc.pid, "log": log_path}


def op_bg_poll(req):
    proc = _background.get(int(req["pid"]))
    if proc is None:
        return {"error": "ProcessLookupError", "message": "no background process {}".format(req["pid"])}
    code = proc.poll()
    return {"running": code is None, "exit_code": None if code is None else (128 - code if code < 0 else code)}


def op_bg_kill(req):
    proc = _background.get(int(req["pid"]))
    if proc is not None:
        _kill_group(proc.pid)
        proc.wait()
    return {}


def _protected_pids():
    pids, pid = set(), os.getpid()
    while pid > 0:  # the agent and its ancestors (the container's init)
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _other_pids(protected):
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in protected]


def _remove_tree(path):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)  # a read-only dir the episode made must not stop the wipe
            for name in os.listdir(path):
                _remove_tree(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


def op_reset(req):
    protected = _protected_pids()
    for _ in range(200):
        others = _other_pids(protected)
        if not others:
            break
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in others:  # reap our own children; others are reaped by init
            try:
                os.waitpid(pid, os.WNOHANG)
            except OSError:
                pass
        time.sleep(0.002)
    _background.clear()
    clean = not _other_pids(protected)
    for d in WRITABLE_DIRS:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            p = os.path.join(d, name)
            _remove_tree(p)
        try:
            if os.listdir(d):
                clean = False
        except OSError:
            pass
    return {"ok": clean}


def op_ping(req):
    return {"pid": os.getpid(), "python": sys.version.split()[0]}


OPS = {"exec": op_exec, "write": op_write, "read": op_read, "bg_start": op_bg_start,
       "bg_poll": op_bg_poll, "bg_kill": op_bg_kill, "reset": op_reset, "ping": op_ping}


def _serve(req):
    global _active
    try:
        result = OPS[req["op"]](req)
    except OSError as e:
        result = {"error": type(e).__name__, "errno": e.errno, "message": str(e.strerror or e)}
    except Exception as e:  # a bug or bad request; the host turns it into an exception
        result = {"error": type(e).__name__, "message": str(e)}
    finally:
        with _active_cond:
            _active -= 1
            _active_cond.notify_all()
    result["id"] = req.get("id")
    _send(result)


def main():
    global _active
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        os.chdir("/work")
    except OSError:
        pass
    stdin = sys.stdin.buffer
    _send({"id": 0, "ready": True, "pid": os.getpid()})
    while True:
        header = _read_exact(stdin, 4)
        if header is None:
            break  # the host went away: exit, so the sandbox dies with it
        body = _read_exact(stdin, struct.unpack(">I", header)[0])
        if body is None:
            break
        req = ast.literal_eval(body.decode())
        with _active_cond:
            if req.get("op") == "reset":  # runs alone: wait for every other request to finish
                while _active:
                    _active_cond.wait()
            _active += 1
        if req.get("op") == "reset":
            _serve(req)
            continue
        try:
            threading.Thread(target=_serve, args=(req,), daemon=True).start()
        except RuntimeError:  # no thread left (pids limit reached): serve inline
            _serve(req)
    os._exit(0)


if __name__ == "__main__":
    main()
