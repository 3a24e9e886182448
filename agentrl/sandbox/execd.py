"""The in-sandbox exec daemon (execd): a small stdlib-only server that runs inside every sandbox.

Role: the host starts it as the sandbox's main process (``python3 -u -c <this file's source>``) and
talks to it over the process's stdin/stdout, so a tool call costs one round trip on an already open
pipe instead of a ``docker exec`` (which creates a process through the engine, about 70 ms).

Wire format, both directions: a 4-byte big-endian length, then that many bytes holding the ``repr``
of a dict of str/bytes/int/float/bool/None/list values, parsed with ``ast.literal_eval`` (safe,
and unlike json it needs no import; bytes need no base64).
Requests carry ``id`` and ``op``; every request gets exactly one response with the same ``id``.
Requests are served concurrently (one thread each), except ``reset`` which runs alone.

Every command is hostile. Invariants:
- The agent is its sandbox's pid 1 (Docker without ``--init``, bwrap ``--as-pid-1``), so no other
  process in the box holds the host channel (an init like tini keeps the container's stdin/stdout
  open, and any same-uid command could read or write it through ``/proc/1/fd``), and the kernel
  drops every signal sent to it from inside its pid namespace (commands cannot kill or stop it).
- The agent is not dumpable (``prctl(PR_SET_DUMPABLE, 0)``): the kernel then asks for
  CAP_SYS_PTRACE, which no command has, before ``ptrace``, ``process_vm_writev`` and opening
  ``/proc/<agent>/{mem,fd,environ,...}``. One check covers them all; a separate uid would need a
  root agent holding CAP_SETUID inside the container, and seccomp cannot filter ``/proc`` paths.
  Commands are dumpable again after their exec (the kernel resets it), so gdb still works in the box.
  Without ctypes, not pid 1, or if the prctl fails, the agent refuses to start (``ready`` carries
  ``error``).
- Only the agent writes to its stdout; commands get their own pipes.
- A command runs in its own session as a child subreaper, so its orphans stay in its tree. When it
  exits, its process group is killed (children must let go of its pipes). At its timeout its whole
  tree is killed, sessions included, and so is every orphan the agent adopted since it started
  (a command that gave up its subreaper role orphans to the agent).
- Commands get ``oom_score_adj`` 1000 so that the kernel's OOM killer picks them, not the agent.
  ``oom_killed`` is the sandbox memory cgroup's oom_kill counter rising while the command ran.
- ``reset`` kills every process except the agent, removes every SysV IPC object, empties every
  writable mount (``/work``, ``/tmp``, ``/dev/shm``, ``/dev/mqueue``, and any other the mount table
  shows), and answers ``ok: false`` (with what is left) unless all of that is verified gone.
- This file must run on the image's ``python3`` (3.9+) with only its standard library (ctypes
  included: python3-minimal alone lacks it) and must not import anything from agentrl.
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

try:
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)
except (ImportError, OSError):  # checked in _harden: the agent refuses to run unprotected
    ctypes = _libc = None

PR_GET_DUMPABLE, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 3, 4, 36
IPC_RMID = 0
WRITABLE_DIRS = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")
# Mounts that are writable but hold no files a command can leave behind.
NO_FILES_FS = {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "devtmpfs", "securityfs", "debugfs"}
_out = sys.stdout.buffer
_out_lock = threading.Lock()
_active = 0  # requests in flight; reset waits for zero
_active_cond = threading.Condition()
_spawn_lock = threading.Lock()  # Popen + registration, against the orphan reaper
_commands = {}  # pid -> Popen of exec commands in flight
_background = {}  # pid -> Popen
_wipe_dirs = list(WRITABLE_DIRS)  # replaced in main() by what the mount table says


def _send(msg):
    data = repr(msg).encode()
    with _out_lock:
        _out.write(struct.pack(">I", len(data)) + data)
        _out.flush()


def _harden():
    """Make the agent untouchable by the commands it runs; returns why not, or None."""
    if os.getpid() != 1:
        return f"the agent must be its sandbox's pid 1 (got pid {os.getpid()})"
    if _libc is None:
        return "python3 has no ctypes: the agent cannot make itself non-dumpable"
    if _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or _libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        return "prctl(PR_SET_DUMPABLE, 0) failed: " + os.strerror(ctypes.get_errno())
    return None


# --- the process table ------------------------------------------------------------------------

def _proc_table():
    """pid -> (ppid, state, start ticks) of every process this pid namespace shows."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            table[int(name)] = (int(fields[1]), fields[0], int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue  # it exited while we looked
    return table


def _registered():
    """Pids whose exit status a Popen object will collect (call with _spawn_lock held)."""
    return set(_commands) | {pid for pid, p in _background.items() if p.returncode is None}


def _reap_orphans():
    """Collect the exit status of orphans the agent adopted as pid 1 (nothing else would, and
    zombies count against the pids limit). Popen's own children are left to Popen."""
    me = os.getpid()
    with _spawn_lock:
        keep = _registered()
        for pid, (ppid, state, _) in _proc_table().items():
            if ppid == me and state == b"Z" and pid not in keep:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def _kill_tree(root, strays=False):
    """SIGKILL ``root`` and all its descendants until none is left. With ``strays``, also every
    orphan the agent adopted since ``root`` started, and its descendants: a command that stopped
    being a subreaper orphans to the agent, where only its start time can still tell it apart.
    A process forked just before its parent's kill is seen in the next round (re-parented, never
    lost), so the loop ends with the tree empty."""
    me = os.getpid()
    since = None
    for _ in range(500):
        table = _proc_table()
        if since is None and root in table:
            since = table[root][2]
        kids = {}
        for pid, (ppid, _, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        tops = [root]
        if strays and since is not None:
            with _spawn_lock:
                keep = _registered()
            tops += [p for p in kids.get(me, ()) if p not in keep and table[p][2] >= since]
        tree, stack = set(), tops
        while stack:
            pid = stack.pop()
            if pid != me and pid in table and pid not in tree:
                tree.add(pid)
                stack.extend(kids.get(pid, ()))
        live = [pid for pid in tree if table[pid][1] != b"Z"]
        if not live:
            break
        _sigkill(live)
        _reap_orphans()
        time.sleep(0.001)
    _reap_orphans()


def _sigkill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass


def _kill_group(pgid):
    for _ in range(50):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        time.sleep(0.002)


# --- exec ---------------------------------------------------------------------------------------

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
    # Orphans of the command re-parent to it instead of the agent, so its tree stays one tree.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _argv(req):
    cmd = req.get("cmd")
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def _env(req):
    env = dict(os.environ)
    env.pop("AGENTRL_OOM_FILE", None)
    env.update(req.get("env") or {})
    return env


def _spawn(registry, argv, **kw):
    with _spawn_lock:  # registered before the reaper can see it exit
        proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_child_setup, **kw)
        registry[proc.pid] = proc
    return proc


def _collect(proc, timeout, limit, stdin_data):
    """Feed stdin, read stdout/stderr (each capped at `limit`) and wait for the command, in this
    thread alone: a fork bomb may leave no pids for helper threads. When the command exits, its
    group is killed so that leftover children release the pipes; at the deadline, its tree."""
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
                _kill_tree(proc.pid, strays=True)
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
        _kill_tree(proc.pid, strays=True)
        proc.wait()
    return (b"".join(bufs[0]), b"".join(bufs[1])), timed_out


def op_exec(req):
    limit = int(req.get("max_output", 1 << 20))
    timeout = req.get("timeout")
    stdin_data = req.get("stdin")
    oom_before = _oom_kills()
    start = time.monotonic()
    try:
        proc = _spawn(
            _commands, _argv(req), cwd=req.get("cwd") or "/work", env=_env(req),
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
        )
    except OSError as e:
        # Command not found, fork refused (pids limit), ...: a tool failure, reported like a shell would.
        code = 127 if isinstance(e, FileNotFoundError) else 126
        return {"exit_code": code, "stdout": "", "stderr": f"{type(e).__name__}: {e}\n",
                "timed_out": False, "oom_killed": False, "duration_s": time.monotonic() - start}
    try:
        out, timed_out = _collect(proc, timeout, limit, stdin_data)
    finally:
        with _spawn_lock:
            _commands.pop(proc.pid, None)
    code = proc.returncode
    exit_code = 128 - code if code < 0 else code
    oom_after = _oom_kills()
    if oom_before is not None and oom_after is not None:
        # Any process of the command's tree (a child under sh included), whatever its exit code
        # says. With several commands running at once, a kill during both is reported on both.
        oom = oom_after > oom_before
    else:  # no counter to read: a SIGKILL that was not our timeout is most likely the OOM killer
        oom = code == -signal.SIGKILL and not timed_out
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
        proc = _spawn(_background, _argv(req), cwd=req.get("cwd") or "/work", env=_env(req),
                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()
    return {"pid": proc.pid, "log": log_path}


def op_bg_poll(req):
    proc = _background.get(int(req["pid"]))
    if proc is None:
        return {"error": "ProcessLookupError", "message": "no background process {}".format(req["pid"])}
    code = proc.poll()
    return {
        "running": code is None,
        "exit_code": None if code is None else (128 - code if code < 0 else code),
    }


def op_bg_kill(req):
    proc = _background.get(int(req["pid"]))
    if proc is not None and proc.returncode is None:
        _kill_tree(proc.pid)
        proc.wait()
    return {}


# --- reset ----------------------------------------------------------------------------------------

def _protected_pids():
    pids, pid = set(), os.getpid()
    while pid > 0:  # the agent and its ancestors (none when it is pid 1)
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _other_pids(protected):
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in protected]


def _unescape(field):
    """A mountinfo path: the kernel writes space, tab, newline and backslash as \\ooo (octal)."""
    head, *rest = field.split("\\")
    return head + "".join(chr(int(part[:3], 8)) + part[3:] for part in rest)


def _writable_mounts():
    """Every mounted directory a command could leave files in: read-write, writable by us (the
    commands' uid), and of a file system that holds files. Read once: no command can mount here."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return list(WRITABLE_DIRS)
    for line in lines:
        fields = line.split()
        try:
            point = _unescape(fields[4])
            fstype = fields[fields.index("-") + 1]
        except (ValueError, IndexError):
            continue
        if ("rw" in fields[5].split(",") and fstype not in NO_FILES_FS and os.path.isdir(point)
                and not os.path.islink(point) and os.access(point, os.W_OK)):
            found.append(point)
    return sorted(set(found) | {d for d in WRITABLE_DIRS if os.path.isdir(d)})


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


def _sysv_ids():
    """(kind, id) of every SysV shared memory segment, semaphore set and message queue."""
    ids = []
    for kind in ("shm", "sem", "msg"):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        ids += [(kind, int(row.split()[1])) for row in rows if row.strip()]
    return ids


def _remove_sysv():
    """IPC_RMID every SysV object. Commands run as our uid, so every object's creator uid (cuid,
    which IPC_SET cannot change) is ours: removal is permitted even if a command gave it away."""
    for kind, ipc_id in _sysv_ids():
        if kind == "shm":
            _libc.shmctl(ipc_id, IPC_RMID, None)
        elif kind == "sem":
            _libc.semctl(ipc_id, 0, IPC_RMID)
        else:
            _libc.msgctl(ipc_id, IPC_RMID, None)


def op_reset(req):
    protected = _protected_pids()
    for _ in range(200):
        others = _other_pids(protected)
        if not others:
            break
        _sigkill(others)
        for pid in others:  # reap our own children (every orphan is ours: we are pid 1)
            try:
                os.waitpid(pid, os.WNOHANG)
            except OSError:
                pass
        time.sleep(0.002)
    _background.clear()
    left = [f"process {p}" for p in _other_pids(protected)]
    _remove_sysv()  # after the kills: a segment still attached would outlive its removal
    left += [f"sysv {kind} {ipc_id}" for kind, ipc_id in _sysv_ids()]
    for d in _wipe_dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            _remove_tree(os.path.join(d, name))
        try:
            left += [os.path.join(d, name) for name in os.listdir(d)]
        except OSError:
            pass
    return {"ok": not left, "left": left[:20]}


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


def _requests(fd):
    """Yield the host's requests from ``fd``; reap adopted orphans whenever it is quiet for 1 s."""
    buf = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    while True:
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from(">I", buf)[0]:
            n = struct.unpack_from(">I", buf)[0]
            body = bytes(buf[4: 4 + n])
            del buf[: 4 + n]
            yield ast.literal_eval(body.decode())
        if not sel.select(1.0):
            _reap_orphans()
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return  # the host went away: exit, so the sandbox dies with it
        buf += chunk


def main():
    global _active, _wipe_dirs
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        os.chdir("/work")
    except OSError:
        pass
    refused = _harden()
    if refused:
        _send({"id": 0, "ready": False, "error": refused})
        os._exit(1)
    _wipe_dirs = _writable_mounts()
    _send({"id": 0, "ready": True, "pid": os.getpid(), "wipes": _wipe_dirs})
    for req in _requests(0):
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
