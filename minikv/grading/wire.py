"""The wire between the grader and a submission's process: messages, proxies and the channel.

Both sides use this module: the parent imports it as ``minikv.grading.wire``, the child (which
may import nothing of minikv before its tripwires are set, see `minikv.grading.child`) loads this
file by its path. So it imports only the standard library (torch lazily, for tensors), and no
pickle that crosses the socket names a class defined here: proxies, tensors and numbers travel
as persistent ids, and exceptions as plain descriptions.

* Plain data (ints, strings, lists, dicts, tensors, ...) goes by value; everything else
  (functions, classes, instances, iterators) as a `Proxy`. Calling a proxied class makes an
  instance on the other side and returns a proxy of it; its method calls and attribute reads go
  across. So a check keeps reading naturally: ``PagedKVCache(..., allocator=MyBlockAllocator(n))``
  in the parent drives the learner's allocator in the child.
* Objects the parent passes to the child go by value when they are plain data, and otherwise as
  proxies the other way round (a minikv ``BlockAllocator`` handed to the learner's block table
  stays in the parent, and the table's calls on it come back). The parent answers only public
  attribute reads and calls on objects it handed over, never a module or a class.
* Learner exceptions come back as their type name, message, cause and the learner's cell line,
  rebuilt as a subclass of the nearest *builtin* exception (``OutOfBlocks`` arrives as a
  ``RuntimeError`` named ``OutOfBlocks``), so ``isinstance(err, RuntimeError)`` and
  ``type(err).__name__`` work and no submission can raise one of the grader's own exceptions.
  ``SystemExit`` and ``KeyboardInterrupt`` arrive as plain ``Exception``\\ s of that name.
* Proxies do not forward ``==``, ``<`` or ``hash``: an object whose ``__eq__`` says yes to
  everything compares by identity in the parent, and so equals nothing a check expects.

Messages are length-prefixed pickles over a socket pair. The parent unpickles what the child sends
with a restricted unpickler (no globals at all; tensors, proxies and numbers travel as persistent
ids), so a hostile message cannot run code in the parent; the child trusts the parent.
"""

from __future__ import annotations

import io
import os
import pickle
import select
import socket
import struct
import sys
import time
import traceback

# Exact types that travel by value (a subclass travels as a proxy: its methods are the learner's).
PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range, slice)
# Builtins the restricted unpickler may name (pickle spells these few through a global).
SAFE_GLOBALS = {("builtins", n) for n in ("complex", "set", "frozenset", "range", "slice", "bytearray")}
TENSOR_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64",
                 "complex128", "int64", "int32", "int16", "int8", "uint8", "bool")
MAX_MESSAGE = 1 << 30   # bytes; a larger message from the child is a protocol error, not a parent OOM
MAX_NODES = 2_000_000   # objects in one decoded message (a pickle can describe huge shared graphs)
MESSAGE_CHARS = 2000    # characters of an exception message that cross
# Exceptions a submission may not raise in the parent: rebuilt as plain Exceptions of that name.
FATAL = ("BaseException", "SystemExit", "KeyboardInterrupt", "GeneratorExit", "BaseExceptionGroup")


class ChildDied(BaseException):
    """The submission's process is gone (exit, crash, time or memory limit): `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Delegation(BaseException):
    """The learner's graded code called minikv's own implementation of what the exercise asks for."""


class ProtocolError(Exception):
    """The other side sent something that is not a message of this protocol."""


# ---- encoding -----------------------------------------------------------------------------------

def _tensor_pid(t) -> tuple:
    import torch

    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), data)


def _tensor_from_pid(pid: tuple):
    import torch

    _, dtype, shape, data = pid
    if dtype not in TENSOR_DTYPES or not isinstance(shape, tuple) or not all(
            type(n) is int and 0 <= n < 2**40 for n in shape) or type(data) is not bytes:
        raise ProtocolError(f"bad tensor {dtype!r} {shape!r}")
    dt = getattr(torch, dtype)
    numel = 1
    for n in shape:
        numel *= n
    if len(data) != numel * dt.itemsize:
        raise ProtocolError("tensor data does not match its shape")
    if not numel:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)


def _is_tensor(obj) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: no tensor can exist
    return torch is not None and type(obj) in (torch.Tensor, getattr(torch.nn, "Parameter", None))


class _Pickler(pickle.Pickler):
    def __init__(self, file, channel):
        super().__init__(file, protocol=5)
        self.channel = channel

    def persistent_id(self, obj):
        if type(obj) in PLAIN:
            return None
        return self.channel.export(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, channel):
        super().__init__(file)
        self.channel = channel

    def find_class(self, module, name):
        if self.channel.trusting:
            return super().find_class(module, name)
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} may not cross into the grader")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and isinstance(pid[0], str)):
            raise ProtocolError(f"bad reference {pid!r:.80}")
        return self.channel.load_pid(pid)


def _describe_error(err: BaseException, depth: int = 0) -> tuple:
    """(type name, builtin bases, message, where, cause): an exception as plain data."""
    try:
        message = str(err)[:MESSAGE_CHARS]
    except BaseException:  # noqa: BLE001 - a learner's __str__ may itself fail
        message = "<unprintable>"
    bases = tuple(c.__name__ for c in type(err).__mro__ if c.__module__ == "builtins")
    frames = traceback.extract_tb(err.__traceback__)
    ours = ("wire.py", "child.py")
    mine = [f for f in frames if f.filename.startswith("<")] or [
        f for f in frames if "site-packages" not in f.filename and not f.filename.endswith(ours)] or frames
    where = f"line {mine[-1].lineno} of {os.path.basename(mine[-1].filename)}" if mine else ""
    cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    cause = _describe_error(cause, depth + 1) if cause is not None and depth < 5 else None
    return (str(type(err).__name__)[:100], bases, message, where, cause)


_REBUILT: dict[tuple[str, str], type] = {}


def rebuild_error(info) -> BaseException:
    """The parent's copy of a child's exception: a subclass of the nearest builtin exception
    (never of a grader class), named as the learner's was, with `where` = the learner's line."""
    import builtins

    if not (isinstance(info, tuple) and len(info) == 5):
        raise ProtocolError("bad error description")
    name, bases, message, where, cause = info
    base = Exception
    for b in bases if isinstance(bases, tuple) else ():
        candidate = getattr(builtins, str(b), None)
        if isinstance(candidate, type) and issubclass(candidate, BaseException):
            base = candidate if (issubclass(candidate, Exception) and b not in FATAL) else Exception
            break
    name = str(name)[:100] or "Exception"
    key = (name, base.__name__)
    if key not in _REBUILT:
        _REBUILT[key] = type(name, (base,), {"__module__": "submission"})
    err = _REBUILT[key].__new__(_REBUILT[key])
    err.args = (str(message),)
    err.where = str(where)
    if cause is not None:
        err.__cause__ = rebuild_error(cause)
    return err


def _check_nodes(obj, budget: list, depth: int = 0) -> None:
    """Bound the work of walking a decoded message (shared references can make it exponential)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > 200:
        raise ProtocolError("message too large or too deep")
    if type(obj) in (list, tuple, set, frozenset):
        for x in obj:
            _check_nodes(x, budget, depth + 1)
    elif type(obj) is dict:
        for k, v in obj.items():
            _check_nodes(k, budget, depth + 1)
            _check_nodes(v, budget, depth + 1)


# ---- proxies ------------------------------------------------------------------------------------

class Proxy:
    """The other side's object. Attribute reads, calls, len/iter/[]/in/repr go across; ==, < and
    hash do not (they are identity here)."""

    __slots__ = ("_channel", "_id", "_kind", "_name", "__weakref__")

    def __init__(self, channel, ident: int, kind: str, name: str):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_name", name)

    def _ask(self, op, *args, **kwargs):
        return self._channel.request(op, self, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __setattr__(self, name, value):
        self._ask("setattr", name, value)

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, **kwargs)

    def __len__(self):
        return self._ask("len")

    def _gather(self, items: list) -> list:
        """Several attribute reads or method calls in one round trip: [("ok", value) | ("raised", err)]."""
        out = self._ask("gather", list(items))
        if not isinstance(out, list) or len(out) != len(items):
            raise ProtocolError("bad gather reply")
        return [("raised", rebuild_error(v)) if k == "err" else ("ok", v) for k, v in out]

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value):
        self._ask("setitem", key, value)

    def __contains__(self, item):
        return self._ask("contains", item)

    def __bool__(self):
        return self._ask("bool")

    def __repr__(self):
        try:
            return str(self._ask("repr"))[:300]
        except Exception:  # noqa: BLE001
            return f"<{self._name}>"

    def __str__(self):
        return repr(self)

    @property
    def __name__(self):
        return self._name.rsplit(".", 1)[-1]


OPS = ("call", "getattr", "setattr", "len", "iter", "next", "getitem", "setitem", "contains", "bool", "repr",
       "gather")


def _do(op: str, obj, args, kwargs):
    if op == "call":
        return obj(*args, **kwargs)
    if op == "getattr":
        return getattr(obj, args[0])
    if op == "setattr":
        setattr(obj, args[0], args[1])
        return None
    if op == "len":
        return len(obj)
    if op == "iter":
        return iter(obj)
    if op == "next":
        return next(obj)
    if op == "getitem":
        return obj[args[0]]
    if op == "setitem":
        obj[args[0]] = args[1]
        return None
    if op == "contains":
        return args[0] in obj
    if op == "bool":
        return bool(obj)
    if op == "repr":
        return repr(obj)[:300]
    if op == "gather":  # many reads in one round trip: [("ok", value) or ("err", description)]
        out = []
        for item in args[0]:
            try:
                out.append(("ok", getattr(obj, item) if isinstance(item, str) else getattr(obj, item[0])(*item[1:])))
            except Exception as err:  # noqa: BLE001
                out.append(("err", _describe_error(err)))
        return out
    raise ProtocolError(f"unknown operation {op!r}")


# ---- the channel (both sides) -------------------------------------------------------------------

class Channel:
    """Requests and replies over a socket, with nested calls both ways.

    `trusting` is True in the child (it decodes the parent's pickles freely) and False in the
    parent (restricted unpickler; only public attributes of objects it handed over are served)."""

    def __init__(self, sock: socket.socket, trusting: bool):
        self.sock, self.trusting = sock, trusting
        self.exported: dict[int, object] = {}   # our objects the other side holds, by id
        self._ids: dict[int, int] = {}          # id(obj) -> export id (keeps identity)
        self.proxies: dict[int, Proxy] = {}     # the other side's objects, by their id
        self.next_request = 0
        self.deadline: float | None = None
        self.on_timeout = None
        self.on_eof = None
        self.on_broken = None
        self.hits: list[str] = []  # (child) minikv reference code run during the current request
        self.depth = 0

    # -- framing --
    def send(self, msg) -> None:
        buf = io.BytesIO()
        _Pickler(buf, self).dump(msg)
        data = buf.getvalue()
        try:
            self.sock.sendall(struct.pack("!Q", len(data)) + data)
        except OSError:  # the other side is gone (a broken pipe): say why, as a read would
            if self.on_eof:
                self.on_eof()
            raise

    def _read(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                    self.on_timeout()
                    raise ProtocolError("time limit")  # on_timeout raises; this is a fallback
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                if self.on_eof:
                    self.on_eof()
                raise EOFError("the other side closed the channel")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self):
        (n,) = struct.unpack("!Q", self._read(8))
        if n > MAX_MESSAGE:
            raise ProtocolError(f"a message of {n} bytes")
        data = self._read(n)
        try:
            msg = _Unpickler(io.BytesIO(data), self).load()
        except (ProtocolError, pickle.UnpicklingError) as err:
            raise ProtocolError(str(err)) from None
        except Exception as err:  # noqa: BLE001 - any malformed pickle
            raise ProtocolError(f"{type(err).__name__}: {err}") from None
        if not self.trusting:
            _check_nodes(msg, [MAX_NODES])
        return msg

    # -- references --
    def export(self, obj):
        if isinstance(obj, Proxy) and obj._channel is self:
            return ("mine", obj._id)  # the other side's own object, going home
        if _is_tensor(obj):
            return _tensor_pid(obj)
        module = type(obj).__module__
        if module == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
            value = obj.item()
            if type(value) in PLAIN:
                return ("value", value)
        if not self.trusting and module.split(".")[0] == "numpy":  # the parent sends arrays by value
            return ("pickled", pickle.dumps(obj))
        if not self.trusting and isinstance(obj, BaseException):
            return ("pickled", pickle.dumps(obj))
        key = id(obj)
        if key not in self._ids:
            self._ids[key] = len(self.exported)
            self.exported[self._ids[key]] = obj
        kind = "class" if isinstance(obj, type) else "function" if callable(obj) else "object"
        try:
            name = obj.__qualname__ if kind != "object" else type(obj).__qualname__
        except Exception:  # noqa: BLE001
            name = "?"
        return ("ref", self._ids[key], kind, str(name)[:100])

    def load_pid(self, pid: tuple):
        tag = pid[0]
        if tag == "tensor" and len(pid) == 4:
            return _tensor_from_pid(pid)
        if tag == "value" and len(pid) == 2 and type(pid[1]) in (int, float, bool, complex):
            return pid[1]
        if tag == "pickled" and self.trusting and len(pid) == 2:
            return pickle.loads(pid[1])
        if tag == "mine" and len(pid) == 2 and pid[1] in self.exported:
            return self.exported[pid[1]]
        if tag == "ref" and len(pid) == 4 and type(pid[1]) is int:
            ident = pid[1]
            if ident not in self.proxies:
                self.proxies[ident] = Proxy(self, ident, str(pid[2]), str(pid[3])[:100])
            return self.proxies[ident]
        raise ProtocolError(f"bad reference {tag!r}")

    # -- calls --
    def request(self, op: str, target, args=(), kwargs=None):
        self.next_request += 1  # also the count of round trips this side started
        rid = self.next_request
        self.send(("req", rid, op, target, tuple(args), dict(kwargs or {})))
        return self.wait(rid, target)

    def wait(self, rid: int, target=None):
        try:
            return self._wait(rid, target)
        except ProtocolError as err:
            if self.on_broken is None:
                raise
            self.on_broken(str(err))
            raise

    def _wait(self, rid: int, target=None):
        while True:
            msg = self.recv()
            if not isinstance(msg, tuple) or not msg:
                raise ProtocolError("not a message")
            if msg[0] == "req":
                self.serve(msg)
                continue
            if msg[0] != "rep" or len(msg) != 5 or msg[1] != rid:
                raise ProtocolError(f"unexpected {msg[0]!r:.20}")
            _, _, status, value, hits = msg
            if hits and not self.trusting:
                who = getattr(target, "_name", "your code")
                raise Delegation(f"`{who}` calls minikv's {hits[0]}: write your own")
            if status == "ok":
                return value
            if status != "err":
                raise ProtocolError("bad reply")
            raise self.load_error(value)

    def load_error(self, info) -> BaseException:
        if self.trusting:  # the parent's exception, pickled when it could be
            pickled, name, message = info
            if pickled is not None:
                try:
                    return pickle.loads(pickled)
                except Exception:  # noqa: BLE001
                    pass
            return RuntimeError(f"{name}: {message}")
        return rebuild_error(info)

    def describe_error(self, err: BaseException):
        if self.trusting:
            return _describe_error(err)
        try:
            pickled = pickle.dumps(err)
        except Exception:  # noqa: BLE001
            pickled = None
        return (pickled, type(err).__name__, str(err)[:MESSAGE_CHARS])

    def serve(self, msg) -> None:
        if len(msg) != 6:
            raise ProtocolError("bad request")
        _, rid, op, target, args, kwargs = msg
        if op not in OPS or not isinstance(args, tuple) or not isinstance(kwargs, dict) or target is None:
            raise ProtocolError(f"bad request {op!r:.20}")
        if not self.trusting and (isinstance(target, Proxy) or op == "gather"):
            raise ProtocolError("the grader serves only objects it handed over")
        outer = self.depth == 0
        if outer:
            self.hits = []
        self.depth += 1
        try:
            if not self.trusting and op in ("getattr", "setattr") and (
                    not isinstance(args[0], str) or args[0].startswith("_")):
                raise AttributeError(f"{args[0]!r:.50}: a submission may use only public attributes of the "
                                     "grader's objects")
            value, status = _do(op, target, args, kwargs), "ok"
            if not self.trusting:
                self._vet_result(value)
        except BaseException as err:  # noqa: BLE001 - the child reports anything, even SystemExit
            if not self.trusting and isinstance(err, (ChildDied, Delegation, KeyboardInterrupt, ProtocolError)):
                raise
            status, value = "err", self.describe_error(err)
        finally:
            self.depth -= 1
        hits = tuple(self.hits) if outer else ()
        self.send(("rep", rid, status, value, hits))

    @staticmethod
    def _vet_result(value) -> None:
        import types

        if isinstance(value, (types.ModuleType, type)):
            raise AttributeError("modules and classes of the grader are not handed to submissions")
