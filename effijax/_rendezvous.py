"""The processes of a run meet on the coordinator's port before jax's own start-up.

jax 0.10's distributed ``initialize`` waits in silence for every process and, when one never
comes, ends the whole interpreter from C++ after ``initialization_timeout`` (a
``DEADLINE_EXCEEDED`` check failure and a stack dump): Python can catch nothing, and nobody is
told which process is missing. So the processes meet first, over a plain TCP socket on the
coordinator's own address. Process 0 listens there; every other process connects (retrying
until process 0 is up) and says ``effijax-join-1 N ID`` (its process count and id). Process 0
checks each hello (the same count, no id twice), keeps the connected processes told who is
still missing (``wait 2,3``), and once all are in says ``go`` and closes the port, which jax's
coordinator service then binds; each process then calls jax's ``initialize`` knowing the others
are alive. Whoever waits says what for through ``print_fn`` (after a second or two, then every
half minute); a timeout, a disagreeing count or a repeated id is a :class:`JoinError` in every
process that knows of it, naming the missing processes. Nothing here imports jax.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable, Sequence

__all__ = ["JoinError", "meet", "ids", "FIRST_SAY_S", "EVERY_S"]

_HELLO = "effijax-join-1"
# A start where every process comes within a couple of seconds says nothing; a longer wait is
# reported then, and again every half minute until it ends.
FIRST_SAY_S = 2.0
EVERY_S = 30.0
_RETRY_S = 0.2  # how often a process retries connecting while process 0 is not up
_GOODBYE_S = 5.0  # how long process 0 waits for the others to hang up after "go"


class JoinError(Exception):
    """The processes did not all meet.

    Attributes:
      setting: the setting to blame, as a library argument name: ``"num_processes"`` (a
        process missing, or started with another count), ``"process_id"`` (an id taken twice),
        ``"coordinator_address"`` (process 0 cannot listen there, or a stranger answers).
      problem: one line saying what happened.
      missing: the processes that did not join (empty when that is not the problem).
      value: the offending value when it is not this process' own setting (the id taken
        twice), else None.
    """

    def __init__(self, setting: str, problem: str, missing: Sequence[int] = (),
                 value: int | None = None):
        self.setting, self.problem, self.missing = setting, problem, tuple(missing)
        self.value = value
        super().__init__(problem)


def ids(numbers: Sequence[int]) -> str:
    """``process 3`` or ``processes 1-4, 7``: process ids for a message, runs collapsed.

    Example:
      >>> ids([1]), ids([1, 2, 3, 4, 7]), ids([2, 5])
      ('process 1', 'processes 1-4, 7', 'processes 2, 5')
    """
    numbers = sorted(numbers)
    runs, first = [], None
    for i, n in enumerate(numbers):
        if first is None:
            first = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            runs.append(str(n) if n == first else f"{first}-{n}")
            first = None
    return ("process " if len(numbers) == 1 else "processes ") + ", ".join(runs)


def meet(address: str, bind: tuple[str, int], num_processes: int, process_id: int, *,
         timeout_s: float, print_fn: Callable[[str], None]) -> None:
    """Returns once every process of the run has connected; see the module docstring.

    Args:
      address: the coordinator's ``host:port`` (processes other than 0 connect there).
      bind: ``(host, port)`` process 0 listens on (``"::"`` or ``""``: every interface), the
        address jax's coordinator service binds afterwards.
      num_processes: processes in the run (2 or more).
      process_id: this process' id.
      timeout_s: how long to wait, from this call, before giving up.
      print_fn: receives a line, without a prefix, whenever this process reports its wait.

    Raises:
      JoinError: a process missing when ``timeout_s`` ran out, a count that differs between
        processes, an id taken twice, process 0 unable to listen on ``bind``, or process 0 gone
        before ``go``.

    Example:
      >>> meet("127.0.0.1:1", ("127.0.0.1", 1), 2, 1, timeout_s=0.5, print_fn=print)
      Traceback (most recent call last):
      ...
      effijax._rendezvous.JoinError: process 0 did not answer at 127.0.0.1:1 within 0.5 s
    """
    clock = _Clock(timeout_s)
    if process_id == 0:
        _lead(address, bind, num_processes, clock, print_fn)
    else:
        _follow(address, num_processes, process_id, clock, print_fn)


class _Clock:
    """The deadline, and when the next progress line is due."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        now = time.monotonic()
        self.deadline = now + timeout_s
        self.next_say = now + min(FIRST_SAY_S, timeout_s / 2)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def due(self) -> bool:
        """Whether a progress line is due now (then the next one is ``EVERY_S`` away)."""
        now = time.monotonic()
        if now < self.next_say or now >= self.deadline:
            return False
        self.next_say = now + EVERY_S
        return True

    def until_event(self) -> float:
        return max(0.0, min(self.deadline, self.next_say) - time.monotonic())

    def status(self) -> str:
        return f"timeout {self.timeout_s:g} s, {max(0, self.left()):.0f} s left"


def _listen(bind: tuple[str, int], backlog: int) -> socket.socket:
    host, port = bind
    if host in ("", "::"):  # every interface, IPv4 too, as jax's default "[::]:port" binds
        if socket.has_dualstack_ipv6():
            return socket.create_server(("::", port), family=socket.AF_INET6,
                                        dualstack_ipv6=True, backlog=backlog)
        return socket.create_server(("", port), backlog=backlog)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # create_server sets SO_REUSEADDR: a port whose last run's connections linger in TIME_WAIT
    # still binds (gRPC's server sets it too, so jax binds right after this socket closes).
    return socket.create_server((host, port), family=family, backlog=backlog)


def _send(sock: socket.socket, line: str) -> None:
    try:
        sock.sendall(line.encode() + b"\n")
    except OSError:  # that process left; the others are what matters now
        pass


def _error_line(error: JoinError) -> str:
    """``error SETTING VALUE MISSING PROBLEM`` ("-" for no value, no missing process)."""
    value = "-" if error.value is None else error.value
    missing = ",".join(map(str, error.missing)) or "-"
    return f"error {error.setting} {value} {missing} {error.problem}"


def _read_error(rest: str) -> JoinError:
    setting, value, missing, problem = (rest.split(" ", 3) + ["", "", ""])[:4]
    return JoinError(setting, problem, [int(x) for x in missing.split(",") if x.isdigit()],
                     int(value) if value.isdigit() else None)


def _open_port(bind: tuple[str, int], n: int) -> socket.socket:
    """Process 0's listening socket on ``bind``, or a :class:`JoinError` naming the port."""
    try:
        return _listen(bind, backlog=min(n, 4096))
    except OSError as e:
        where = f"[{bind[0]}]:{bind[1]}" if ":" in bind[0] else f"{bind[0] or '*'}:{bind[1]}"
        raise JoinError("coordinator_address", f"process 0 cannot listen on {where} ("
                        f"{e.strerror or e}): another program, or another process 0, holds that "
                        "port; choose a free port for the coordinator") from None


class _Lobby:
    """Process 0's side of the meeting: its port and the connections to it so far."""

    def __init__(self, server: socket.socket, n: int):
        self.server, self.n = server, n
        self.selector = selectors.DefaultSelector()
        self.selector.register(server, selectors.EVENT_READ)
        self.peers: dict[int, socket.socket] = {}  # process id -> its connection
        self.unnamed: dict[socket.socket, bytes] = {}  # connections whose hello has not ended
        self.left: set[int] = set()  # processes that joined and then hung up

    def missing(self) -> list[int]:
        return [i for i in range(1, self.n) if i not in self.peers]

    def tell(self, line: str) -> None:
        """Sends ``line`` to every process that has joined."""
        for sock in self.peers.values():
            _send(sock, line)

    def abort(self, error: JoinError) -> JoinError:
        """Tells every joined process of ``error``, and returns it to raise."""
        self.tell(_error_line(error))
        return error

    def drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        sock.close()

    def accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:  # it gave up between connecting and being accepted
            return
        conn.settimeout(_GOODBYE_S)  # sends only: reads happen when readable
        self.selector.register(conn, selectors.EVENT_READ)
        self.unnamed[conn] = b""

    def read(self, sock: socket.socket) -> bool:
        """Reads what ``sock`` sent; returns whether the set of joined processes changed."""
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if sock in self.unnamed:
            return self._hear_hello(sock, data)
        if data:  # a process that had joined: it says nothing more
            return False
        pid = next(i for i, s in self.peers.items() if s is sock)
        del self.peers[pid]  # it hung up: it died, or gave up waiting
        self.left.add(pid)
        self.drop(sock)
        return True

    def _hear_hello(self, sock: socket.socket, data: bytes) -> bool:
        """Adds ``data`` to ``sock``'s hello; once the hello is whole, admits its process."""
        if not data:
            del self.unnamed[sock]
            self.drop(sock)
            return False
        self.unnamed[sock] += data
        if b"\n" not in self.unnamed[sock]:
            if len(self.unnamed[sock]) > 256:  # not one of ours
                del self.unnamed[sock]
                self.drop(sock)
            return False
        hello = self.unnamed.pop(sock).split(b"\n", 1)[0].decode("ascii", "replace").split()
        if len(hello) != 3 or hello[0] != _HELLO or not all(x.isdigit() for x in hello[1:]):
            self.drop(sock)  # a stranger (a port scan, a health check): not our business
            return False
        return self._admit(sock, int(hello[1]), int(hello[2]))

    def _admit(self, sock: socket.socket, count: int, pid: int) -> bool:
        """Makes process ``pid`` (started for ``count`` processes) a peer, or stops the run."""
        n = self.n
        error = None
        if count != n:
            error = JoinError("num_processes", f"process {pid} was started with {count} "
                              f"processes and process 0 with {n}: start every process with the "
                              "same process count")
        elif pid in self.peers:
            error = JoinError("process_id", f"two processes were started as process {pid} of "
                              f"{n}: each needs its own id in [0, {n})", value=pid)
        elif not 0 < pid < n:  # no effijax process says that
            self.drop(sock)
            return False
        if error is not None:
            _send(sock, _error_line(error))
            self.drop(sock)
            raise self.abort(error)
        self.peers[pid] = sock
        return True

    def close(self) -> None:
        for sock in (*self.peers.values(), *self.unnamed):
            sock.close()
        if self.server.fileno() != -1:
            self.server.close()
        self.selector.close()


def _gather(lobby: _Lobby, address: str, clock: _Clock,
            print_fn: Callable[[str], None]) -> None:
    """Returns once every process has joined; keeps the joined told who is still missing."""
    n = lobby.n
    while missing := lobby.missing():
        if clock.left() <= 0:
            gone = [i for i in missing if i in lobby.left]
            whose = "its" if len(gone) == 1 else "their"
            also = f" ({ids(gone)} joined, then hung up: see {whose} output)" if gone else ""
            raise lobby.abort(JoinError("num_processes", f"{ids(missing)} did not join "
                                        f"{address} within {clock.timeout_s:g} s{also}", missing))
        if clock.due():
            print_fn(f"process 0 of {n}: waiting for {len(missing)} more at {address}: "
                     f"{ids(missing)} ({clock.status()})")
        changed = False
        for key, _ in lobby.selector.select(clock.until_event()):
            if key.fileobj is lobby.server:
                lobby.accept()
            elif lobby.read(key.fileobj):
                changed = True
        if changed and len(lobby.peers) < n - 1:
            lobby.tell("wait " + ",".join(map(str, lobby.missing())))


def _release(lobby: _Lobby) -> None:
    """Says ``go`` to every process, gives the port up for jax, and waits for the goodbyes."""
    lobby.tell("go")
    # The port is jax's from here. The others hang up first, so the connections' TIME_WAIT
    # lingers on their side, not on the port jax binds.
    lobby.selector.unregister(lobby.server)
    lobby.server.close()
    end = time.monotonic() + _GOODBYE_S
    for sock in lobby.peers.values():
        try:
            sock.settimeout(max(0.01, end - time.monotonic()))
            while sock.recv(4096):
                pass
        except OSError:
            pass


def _lead(address: str, bind: tuple[str, int], n: int, clock: _Clock,
          print_fn: Callable[[str], None]) -> None:
    lobby = _Lobby(_open_port(bind, n), n)
    try:
        _gather(lobby, address, clock, print_fn)
        _release(lobby)
    finally:
        lobby.close()


def _follow(address: str, n: int, pid: int, clock: _Clock,
            print_fn: Callable[[str], None]) -> None:
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") else host
    sock = None
    while sock is None:
        if clock.left() <= 0:
            raise JoinError("num_processes", f"process 0 did not answer at {address} within "
                            f"{clock.timeout_s:g} s", [0])
        if clock.due():
            print_fn(f"process {pid} of {n}: waiting for process 0 at {address} "
                     f"({clock.status()})")
        try:
            sock = socket.create_connection((host, int(port)),
                                            timeout=max(0.05, min(2.0, clock.left())))
        except OSError:  # refused (process 0 not listening yet), a name not resolving yet, ...
            time.sleep(max(0.0, min(_RETRY_S, clock.left())))
    with sock:
        _send(sock, f"{_HELLO} {n} {pid}")
        missing: list[int] | None = None  # unknown until process 0 has read the hello
        buffer = b""
        while True:
            if clock.left() <= 0:
                if missing is None:  # a process 0 answers at once: this is something else
                    raise JoinError("coordinator_address", f"something at {address} accepted "
                                    "the connection but did not answer as effijax's process 0 "
                                    f"within {clock.timeout_s:g} s")
                raise JoinError("num_processes", f"{ids(missing)} did not join {address} "
                                f"within {clock.timeout_s:g} s", missing)
            if clock.due():
                what = ("process 0's answer" if missing is None else
                        f"{len(missing)} more: {ids(missing)}")
                print_fn(f"process {pid} of {n}: waiting for {what} at {address} (process 0 "
                         f"is up; {clock.status()})")
            sock.settimeout(max(0.01, clock.until_event()))
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                raise JoinError("num_processes", f"process 0 at {address} hung up before every "
                                "process had joined (see its output)")
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                word, _, rest = line.decode("utf-8", "replace").partition(" ")
                if word == "go":
                    return  # hanging up first (the with block) keeps TIME_WAIT on this side
                if word == "wait":
                    missing = [int(x) for x in rest.split(",") if x.isdigit()]
                elif word == "error":
                    raise _read_error(rest)
                else:
                    raise JoinError("coordinator_address", f"something other than effijax's "
                                    f"process 0 answers at {address}")
