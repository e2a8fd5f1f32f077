"""The guest agent: PID 1 of every cleanroom VM (standard library only).

It sets up the guest's pseudo file systems, finds the control port (a virtio-serial port named
``ctl``), says HELLO (with the ``features`` it serves), and then serves the host's frames: RUN
(the episode), EXEC, PUT, GET one at a time, as the first protocol did; frames that carry an
``id`` are multiplexed requests (``muxed.py``: commands with stdin, PTY and user, streams
and tar archives both ways), each in a worker thread of its own, several at once; PING and
SHUTDOWN at any time. When the channel closes, or on SHUTDOWN, it powers the VM off. An
episode is a command, or a Python function run by the warm worker (``warm.py``): when the
baseline has one, the agent starts that worker at boot and says HELLO once it is ready.

Snapshots (the qemu driver's templates): after SNAPSHOT_PREPARE the agent no longer takes a
closed channel for "host gone": the VM is about to be saved, and every clone restored from it
sees the template's host connection vanish. It waits for the next host instead, which sends
RESEED (host entropy, the clone's id, the wall clock); the agent mixes the entropy into the
kernel's pool and forces a CRNG reseed, reseeds Python's ``random`` if it is loaded, sets the
clock and says HELLO again. In a baseline the native helper (``reseed.c``, started at
SNAPSHOT_PREPARE, ``reseed_helper.py``) does all that but the ``random`` part: under TCG a
clone translates every code path it runs first, and the interpreter's path is ~10x longer.
The agent keeps the entropy: each function episode's child reseeds its ``random`` (and
numpy's) from it, since a template's worker shares its state with every clone.
Nothing here reads ``/proc/sys/kernel/random/boot_id`` before that (the kernel fixes it at its
first read, so each clone must be the first to read it).

A VM whose episode has an egress allowlist has a NIC: at boot ``guestnet.setup()`` configures
it, reports it in HELLO (``network``) and gives every process it starts the proxy variables.

As PID 1 it forks: the parent only reaps orphans and powers off when the agent child ends; the
child does the work. Outside a VM (the ``fake`` driver, tests) set ``CLEANROOM_AGENT_SOCKET`` to
a unix socket to connect to and ``CLEANROOM_GUEST_ROOT`` to relocate ``/run/cleanroom``; the
``gvisor`` driver sets ``CLEANROOM_AGENT_SOCKET`` too (the agent is PID 1 of the sandbox).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time

TYPE_CHECKING = False  # typing costs ~0.1 s of guest boot under TCG; annotations stay lazy
if TYPE_CHECKING:
    from typing import Any

if __package__:  # on the host, as part of the package (a failed import costs ~30 ms in a VM)
    from cleanroom.agent import guestnet
    from cleanroom.agent.handlers import (
        BASE_ENV,
        NETWORK,
        Handlers,
        prepare_guest_root,
        warm_module,
    )
    from cleanroom.agent.muxed import REQUESTS, ROUTED, Request, failed
    from cleanroom.agent.protocol import (
        FEATURES,
        HEARTBEAT_S,
        Frame,
        Kind,
        dumps,
        encode,
        read_frame,
    )
    from cleanroom.agent.reseed_helper import Prefixed, ReseedHelper
else:  # in the guest, next to protocol.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import guestnet  # type: ignore[import-not-found,no-redef]
    from handlers import BASE_ENV, NETWORK, Handlers, prepare_guest_root, warm_module  # type: ignore[no-redef,import-not-found]
    from muxed import REQUESTS, ROUTED, Request, failed  # type: ignore[no-redef,import-not-found]
    from protocol import FEATURES, HEARTBEAT_S, Frame, Kind, dumps, encode, read_frame  # type: ignore[no-redef,import-not-found]
    from reseed_helper import Prefixed, ReseedHelper  # type: ignore[no-redef,import-not-found]

AGENT_VERSION = "0.5.0"
PORT_NAME = "ctl"
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
RECONNECT_POLL_S = 0.002
ENTRY_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entry.json")


def log(message: str) -> None:
    print(f"cleanroom-agent: {message}", file=sys.stderr, flush=True)


# -- booting -------------------------------------------------------------------------------------


def power_off() -> None:
    """Halt the VM at once (the host destroys it anyway; this just makes it quick).

    In a sandbox (gVisor: the agent reaches the host over ``CLEANROOM_AGENT_SOCKET``) there is
    no sysrq: PID 1 exiting ends the sandbox, so it just exits.
    """
    if not os.environ.get("CLEANROOM_AGENT_SOCKET"):
        try:
            with open("/proc/sysrq-trigger", "w") as trigger:
                trigger.write("o")
        except OSError:
            pass
        time.sleep(5)
    os._exit(0)


def open_control_port(deadline_s: float = 30.0) -> Any:
    """Open the virtio-serial port named ``ctl`` (or the test socket) as a binary stream."""
    path = os.environ.get("CLEANROOM_AGENT_SOCKET")
    if path:
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return sock.makefile("rwb", buffering=0)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        base = "/sys/class/virtio-ports"
        for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            try:
                with open(f"{base}/{entry}/name") as f:
                    if f.read().strip() != PORT_NAME:
                        continue
                return open(f"/dev/{entry}", "r+b", buffering=0)
            except OSError:
                pass  # ENXIO until the host side is connected
        time.sleep(0.005)
    raise RuntimeError("control port did not appear")


# -- serving ------------------------------------------------------------------------------------


class Agent(Handlers):
    """Serves one host connection."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.busy = threading.Event()  # set while any request runs (heartbeats flow)
        self.snapshotted = False  # after SNAPSHOT_PREPARE: EOF means "wait for the next host"
        self.pool: Any = None  # /dev/urandom, opened by SNAPSHOT_PREPARE for RESEED
        self.idle = threading.Event()
        self.idle.set()
        self.active = 0  # requests running (each in a worker thread)
        self.count = threading.Lock()
        self.requests: dict[int, Request] = {}  # the multiplexed ones, by the host's id
        self.workers: list[threading.Lock] = []  # idle worker threads, each asleep on its lock
        self.jobs: dict[threading.Lock, Any] = {}
        self.warm: Any = None  # warm.Worker: the pre-importing Python worker, if any
        self.entropy = b""  # the host's RESEED bytes (function episodes reseed from them)
        self.helper: ReseedHelper | None = None  # holds the port from a snapshot to RESEED

    def send(self, kind: int, header: dict[str, Any] | None = None, body: bytes = b"") -> None:
        data = encode(kind, header, body)
        with self.lock:
            view = memoryview(data)
            while view:
                written = self.stream.write(view)
                view = view[written:]

    def hello_fields(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        header = hello_header(extra)
        if NETWORK:
            header["network"] = NETWORK
        if self.warm is not None:
            header["warm"] = self.warm.hello_facts()
        return header

    def hello(self, extra: dict[str, Any] | None = None) -> None:
        self.send(Kind.HELLO, self.hello_fields(extra))

    def serve(self) -> None:
        self.hello()
        threading.Thread(target=self.heartbeat, daemon=True).start()
        # a worker thread started now: in a template it is saved with the agent, so a clone's
        # first request starts no thread (~0.1 s under TCG in a fresh clone)
        self.workers.append(self.new_worker())
        while True:
            try:
                frame = self.next_frame()
            except EOFError:
                if not self.snapshotted:
                    return
                time.sleep(RECONNECT_POLL_S)  # a clone: the port reads EOF until its host connects
                continue
            if frame is None:  # the reseed helper answered a clone's RESEED
                continue
            if frame.kind == Kind.PING:
                self.send(Kind.PONG, {"t": frame.header.get("t")})
            elif frame.kind == Kind.SHUTDOWN:
                return
            elif frame.kind == Kind.SNAPSHOT_PREPARE and self.wait_idle():
                self.pool = prepare_snapshot()
                self.snapshotted = True
                self.send(Kind.OK, {"prepared": True, **self.start_helper()})
            elif frame.kind == Kind.RESEED and self.pool is not None and self.wait_idle():
                facts = reseed(self.pool, frame.body, frame.header)
                self.adopt_reseed(frame.body)
                self.hello(facts)
            elif "id" in frame.header:
                self.route(frame)
            elif self.busy.is_set() and not self.wait_idle():
                self.send(Kind.ERROR, {"message": "busy: one request at a time"})
            else:
                self.submit(self.handle, frame)

    def route(self, frame: Frame) -> None:
        """A multiplexed frame: input for a running request, or a new request (``REQUESTS``)."""
        rid = frame.header["id"]
        if frame.kind in ROUTED:
            request = self.requests.get(rid)
            if request is not None:  # else it just ended: its late input has nowhere to go
                request.deliver(frame)
            return
        handler = REQUESTS.get(frame.kind)
        if handler is None or not isinstance(rid, int) or rid in self.requests:
            why = f"no request of kind {frame.kind} with id {rid!r} here"
            self.send(Kind.FAILED, {"id": rid, "code": "unsupported", "message": why})
            return
        request = self.requests[rid] = Request(self, rid)
        self.submit(self.serve_request, (handler, request, frame.header))

    def serve_request(self, job: Any) -> None:
        handler, request, header = job
        try:
            handler(self, request, header)
        except Exception as exc:  # the request failed; the agent and the others go on
            failed(request, exc)
        finally:
            self.requests.pop(request.rid, None)
            request.detach()

    def submit(self, work: Any, arg: Any) -> None:
        """Run ``work(arg)`` in an idle worker thread (a new one if none is idle)."""
        with self.count:
            self.active += 1
            self.busy.set()
            self.idle.clear()
            wake = self.workers.pop() if self.workers else self.new_worker()
        self.jobs[wake] = (work, arg)
        wake.release()

    def new_worker(self) -> threading.Lock:
        wake = threading.Lock()
        wake.acquire()
        threading.Thread(target=self.work, args=(wake,), daemon=True).start()
        return wake

    def work(self, wake: threading.Lock) -> None:
        while True:
            wake.acquire()
            work, arg = self.jobs.pop(wake)
            try:
                work(arg)
            finally:
                with self.count:
                    self.active -= 1
                    if self.active == 0:
                        self.busy.clear()
                        self.idle.set()
                    self.workers.append(wake)

    def next_frame(self) -> Frame | None:
        """The next request. After a snapshot the reseed helper reads the first: if it answered
        a RESEED, adopt that (None); else read the frame it began, from its bytes on."""
        helper, self.helper = self.helper, None
        if helper is None:
            return read_frame(self.stream)
        status, consumed = helper.outcome()
        if status == b"H":
            self.adopt_reseed(read_frame(io.BytesIO(consumed)).body)
            return None
        return read_frame(Prefixed(consumed, self.stream))  # type: ignore[arg-type]

    def adopt_reseed(self, entropy: bytes) -> None:
        """A clone now: its host closing the channel ends it; its Python diverges too."""
        self.snapshotted = False
        self.entropy = entropy
        if "random" in sys.modules:  # only a module already loaded shares the template's state
            sys.modules["random"].seed(entropy + os.urandom(16))

    def start_helper(self) -> dict[str, str]:
        """Let the native helper answer the clone's RESEED; which one will, and why not it."""
        try:
            self.helper = ReseedHelper.start(self.stream, self.pool, self.hello_prefix())
        except OSError as exc:
            return {"reseeder": "python", "reseeder_note": f"{type(exc).__name__}: {exc}"}
        return {"reseeder": "native"}

    def hello_prefix(self) -> str:
        """The HELLO a clone sends, as compact JSON without its closing brace (for the helper,
        which adds the clone's facts and its own uptime)."""
        fields = self.hello_fields()
        fields.pop("boot_time_s", None)
        return dumps(fields)[:-1]

    def wait_idle(self, timeout_s: float = 2.0) -> bool:
        """Let a request that has sent its last frame finish (the host may already be ahead:
        e.g. SNAPSHOT_PREPARE right after an EXEC's DONE, before the handler cleared ``busy``)."""
        self.idle.wait(timeout_s)
        return not self.busy.is_set()

    def heartbeat(self) -> None:
        """While a request runs, tell the host we are alive (it treats silence as a crash).

        Idle, it blocks without a timer: a restored clone must not spend its first
        milliseconds waking this thread (under TCG every new code path costs translation).
        """
        while True:
            self.busy.wait()
            time.sleep(HEARTBEAT_S)
            if self.busy.is_set():
                self.send(Kind.HEARTBEAT, {"t": time.monotonic()})

    def handle(self, frame: Frame) -> None:
        try:
            if frame.kind == Kind.RUN:
                self.run_episode(frame.header)
            elif frame.kind == Kind.EXEC:
                self.run_process(frame.header)
                self.send(Kind.DONE)
            elif frame.kind == Kind.PUT:
                self.put(frame.header, frame.body)
            elif frame.kind == Kind.GET:
                self.send_file(frame.header["path"], frame.header["path"], "get")
                self.send(Kind.DONE)
            else:
                self.send(Kind.ERROR, {"message": f"unexpected frame {frame.kind}"})
        except Exception as exc:  # report, never die: the host decides what happens next
            self.send(Kind.ERROR, {"message": f"{type(exc).__name__}: {exc}"})


def hello_header(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HELLO: who this agent is, plus ``extra`` (a clone's reseed facts)."""
    header = {
        "agent_version": AGENT_VERSION,
        "protocol": 1,
        "boot_time_s": round(time.clock_gettime(time.CLOCK_BOOTTIME), 2),  # = uptime
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "features": list(FEATURES),
    }
    header.update(extra or {})
    return header


def prepare_snapshot(pool_path: str = "/dev/urandom") -> Any:
    """What a clone's RESEED needs, made ready before the snapshot: under TCG every code path
    a clone runs for the first time is translated anew, so the clone should run few of them.

    It rehearses RESEED and the HELLO after it (the frame decoded, fresh bytes mixed in with no
    entropy credited, the clock set to itself, the answer encoded but not sent), so the pages,
    page tables, lazily bound libc symbols and Python caches of that path are in the template:
    a clone then reads nothing from disk and copies no page on it, it only translates it. Then
    a first EXEC (``true``, its frames discarded): the clone's own first one is ~20% faster.
    Returns the pool (``/dev/urandom`` opened for writing: a handle, no state).
    """
    pool = open(pool_path, "wb", buffering=0)  # noqa: SIM115 - kept for the clone
    probe = {"clone_id": "env-" + "0" * 16, "time_ns": time.time_ns()}
    frame = read_frame(io.BytesIO(encode(Kind.RESEED, probe, os.urandom(64))))
    encode(Kind.HELLO, hello_header(reseed(pool, frame.body, frame.header, credit=False)))
    Agent(io.BytesIO()).run_process({"argv": ["true"], "timeout_s": 30})
    return pool


def reseed(
    pool: Any, entropy: bytes, header: dict[str, Any], credit: bool = True
) -> dict[str, Any]:
    """Make a restored clone diverge from its siblings; returns facts for its HELLO.

    The entropy goes into the input pool (a plain write, then RNDADDENTROPY, which credits it)
    and RNDRESEEDCRNG makes the CRNG draw from the pool now, not at its next scheduled reseed.
    ``/proc/sys/kernel/random/boot_id`` is left unread: the first reader in the clone (after
    this) makes the clone's own; the agent reports the host's clone id instead. Without
    ``credit`` (the template's rehearsal) the bytes are mixed in but credit no entropy.
    """
    import fcntl
    import struct

    started = time.monotonic()
    facts: dict[str, Any] = {
        "start": "snapshot",
        "reseeder": "python",
        "clone_id": header.get("clone_id"),
    }
    bits = 8 * len(entropy) if credit else 0
    try:
        pool.write(entropy)
        fcntl.ioctl(pool, RNDADDENTROPY, struct.pack("ii", bits, len(entropy)) + entropy)
        fcntl.ioctl(pool, RNDRESEEDCRNG)
        facts["reseeded"] = True
    except OSError as exc:
        facts["reseeded"] = False
        facts["reseed_error"] = f"{type(exc).__name__}: {exc}"
    when = header.get("time_ns")
    if isinstance(when, int):
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, when)
        except OSError as exc:
            facts["clock_error"] = str(exc)
    facts["reseed_ms"] = round((time.monotonic() - started) * 1000, 3)
    return facts


def serve_forever() -> None:
    """Serve the host; a baseline's warm worker starts first and is ready before HELLO."""
    worker = None
    if os.path.isfile(ENTRY_FILE):  # a function entrypoint (written by the baseline builder)
        warm = warm_module()
        config = warm.boot_config(ENTRY_FILE)
        worker = warm.start(config, dict(BASE_ENV)) if config is not None else None
    agent = Agent(open_control_port())
    if worker is not None:
        worker.wait_ready(warm.READY_S)
        agent.warm = worker
    agent.serve()


def become_subreaper() -> None:
    """Outside a VM, keep orphaned descendants below the agent so its host can find them all."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError, ImportError):
        pass


def main() -> None:
    if os.getpid() != 1:
        become_subreaper()
        serve_forever()
        return
    prepare_guest_root()
    NETWORK.update(guestnet.setup())  # a NIC only if the episode has an egress allowlist
    child = os.fork()
    if child == 0:
        try:
            serve_forever()
        except BaseException as exc:
            log(f"fatal: {type(exc).__name__}: {exc}")
        os._exit(0)
    while True:  # PID 1: reap every orphan; when the agent ends, the VM ends
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            break
        if pid == child:
            break
    power_off()


if __name__ == "__main__":
    main()
