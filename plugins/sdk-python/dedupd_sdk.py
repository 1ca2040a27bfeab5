"""Guest SDK for **dedupd** business handlers written in Python.

A Python handler is a WebAssembly component built by componentize-py from an app module
and this SDK against the WIT world ``dedupd:handler/dedupd-handler@0.1.0``
(``wit/handler.wit``). The module wraps the bindings componentize-py generates
(``wit_world``) in the same small API as the Rust SDK (``plugins/sdk``)::

    import dedupd_sdk
    from dedupd_sdk import Message, Permanent, state

    def handle(msg: Message) -> None:
        event = msg.json()
        if "order_id" not in event:
            raise Permanent("no order_id")
        state.put(f"seen/{event['order_id']}", b"1")

    Handler = dedupd_sdk.export(handle)

Semantics (see the WIT file for the full contract): ``handle`` runs at least once per
message; everything written through :mod:`state`, :func:`insert_unique`,
:func:`advance_version`, :func:`compare_and_set` and :func:`emit` commits atomically with
the message's claim, or not at all when ``handle`` raises. :class:`Retryable` and
:class:`Permanent` say what the engine should do; any other exception traps the instance
(like a Rust panic): the engine retries the message, then dead-letters it. External side
effects should carry :func:`operation_key` as their idempotency key.

What the Python runtime sees of the system: :func:`export` reseeds the ``random`` module
from the message (an operation key) before each call, so a retry draws the same numbers;
``time.time()`` is the message's received-at; the environment is empty, no directory is
open and every socket use is refused. ``os.urandom`` (and ``secrets``) read the host's
random stream, derived from the message, but through a runtime that keeps unread bytes
across calls: on an instance that served other messages first they differ, so do not rely
on them for anything a retry must repeat. None of it is secret. Prefer :func:`now_ms` and
:func:`operation_key`, which say what they are.
"""

import json
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type, Union

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import handler as _wit
from wit_world.imports import host as _host

Level = _host.Level
Entry = _host.Entry

__all__ = [
    "Entry",
    "HandlerError",
    "Level",
    "Message",
    "Permanent",
    "Retryable",
    "advance_version",
    "compare_and_set",
    "emit",
    "export",
    "insert_unique",
    "log",
    "now_ms",
    "operation_key",
    "state",
]


class HandlerError(Exception):
    """Why a message failed; every write of the attempt is rolled back."""

    retryable = False

    @property
    def reason(self) -> str:
        """The reason text."""
        return str(self)


class Retryable(HandlerError):
    """Try again later (bounded, with backoff), then dead-letter."""

    retryable = True


class Permanent(HandlerError):
    """Dead-letter now: retrying cannot help (e.g. a payload that does not parse)."""


def _no_constants(name: str) -> Any:
    # json.loads accepts NaN and Infinity; JSON (and serde_json in the Rust SDK) does not.
    raise ValueError(f"{name} is not valid JSON")


class Message:
    """One message as the engine delivers it (``handler.message`` in the WIT)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: _wit.Message) -> None:
        self._raw = raw

    @property
    def subscriber(self) -> str:
        return self._raw.subscriber

    @property
    def id(self) -> str:
        """The idempotency key's text."""
        return self._raw.id

    @property
    def key(self) -> Optional[str]:
        """The partition key, if the source had one."""
        return self._raw.key

    @property
    def headers(self) -> List[Tuple[str, str]]:
        return self._raw.headers

    @property
    def payload(self) -> bytes:
        """The payload bytes (JSON a source parsed arrives in canonical form)."""
        return self._raw.payload

    @property
    def attempt(self) -> int:
        """1 on the first attempt."""
        return self._raw.attempt

    @property
    def received_at_ms(self) -> int:
        return self._raw.received_at_ms

    def text(self) -> str:
        """The payload as UTF-8 text; a payload that is not UTF-8 is a permanent error."""
        try:
            return self._raw.payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Permanent(f"payload is not UTF-8: {e}") from None

    def json(self, object_pairs_hook: Optional[Callable[[list], Any]] = None) -> Any:
        """The payload parsed as JSON; a payload that does not parse is a permanent error
        (``invalid payload: ...``), as in the Rust SDK."""
        try:
            return json.loads(
                self._raw.payload,
                parse_constant=_no_constants,
                object_pairs_hook=object_pairs_hook,
            )
        except HandlerError:
            raise
        except (ValueError, UnicodeDecodeError) as e:
            raise Permanent(f"invalid payload: {e}") from None

    def header(self, name: str) -> Optional[str]:
        """The first header named ``name`` (case-sensitive), if any."""
        for k, v in self._raw.headers:
            if k == name:
                return v
        return None

    def __repr__(self) -> str:
        return f"Message(subscriber={self.subscriber!r}, id={self.id!r}, attempt={self.attempt})"


def _bytes(b: Union[str, bytes]) -> bytes:
    return b.encode("utf-8") if isinstance(b, str) else bytes(b)


class state:
    """Key/value state of this subscriber, read-your-writes inside one ``handle`` call.

    Keys and values are bytes (``str`` is encoded as UTF-8). Writes are buffered in the
    message's transaction and applied only if ``handle`` returns normally.
    """

    @staticmethod
    def get(key: Union[str, bytes]) -> Optional[bytes]:
        """Reads ``key``; sees this call's own earlier writes."""
        return _host.get(_bytes(key))

    @staticmethod
    def put(key: Union[str, bytes], value: Union[str, bytes]) -> None:
        """Writes ``key`` = ``value``."""
        _host.put(_bytes(key), _bytes(value))

    @staticmethod
    def delete(key: Union[str, bytes]) -> None:
        """Deletes ``key`` (a no-op if absent)."""
        _host.delete(_bytes(key))

    @staticmethod
    def scan(prefix: Union[str, bytes], limit: int) -> List[Entry]:
        """Entries whose key starts with ``prefix``, in key order, at most ``limit`` (the
        host caps it at 1000)."""
        return _host.scan(_bytes(prefix), limit)

    @staticmethod
    def compare_and_set(
        key: Union[str, bytes],
        expected: Optional[Union[str, bytes]],
        new: Union[str, bytes],
    ) -> bool:
        """Writes ``new`` if the current value equals ``expected`` (``None``: the key must
        be absent). Returns whether it wrote."""
        exp = None if expected is None else _bytes(expected)
        return _host.compare_and_set(_bytes(key), exp, _bytes(new))


compare_and_set = state.compare_and_set


def insert_unique(namespace: str, key: str) -> bool:
    """Business uniqueness: records ``key`` in ``namespace``; ``True`` the first time,
    ``False`` if any earlier message of this state scope already recorded it."""
    return _host.insert_unique(namespace, key)


def advance_version(key: str, version: int) -> bool:
    """Ordering guard: stores ``version`` under ``key`` and returns ``True`` only if it is
    greater than the stored one (or none is stored)."""
    return _host.advance_version(key, version)


def emit(
    topic: str,
    key: Optional[str] = None,
    headers: Sequence[Tuple[str, str]] = (),
    payload: Union[str, bytes] = b"",
) -> str:
    """Queues an outbound message in the transactional outbox; returns its deterministic
    message id (the same on every attempt of this message)."""
    return _host.emit(topic, key, list(headers), _bytes(payload))


def operation_key(name: str) -> str:
    """A deterministic idempotency key for the external operation ``name``, the same on
    every attempt of this message."""
    return _host.operation_key(name)


def now_ms() -> int:
    """The message's received-at time (ms since the epoch), not the wall clock."""
    return _host.now_ms()


class log:
    """The engine's log (rate-limited per subscriber)."""

    @staticmethod
    def log(level: Level, text: str) -> None:
        _host.log(level, text)

    @staticmethod
    def trace(text: str) -> None:
        _host.log(Level.TRACE, text)

    @staticmethod
    def debug(text: str) -> None:
        _host.log(Level.DEBUG, text)

    @staticmethod
    def info(text: str) -> None:
        _host.log(Level.INFO, text)

    @staticmethod
    def warn(text: str) -> None:
        _host.log(Level.WARN, text)

    @staticmethod
    def error(text: str) -> None:
        _host.log(Level.ERROR, text)


def export(handle: Callable[[Message], None]) -> Type[exports.Handler]:
    """The component's ``dedupd:handler/handler`` export for the function ``handle``.

    Bind the result to the name ``Handler`` in the app module (componentize-py looks the
    export up by that name): ``Handler = dedupd_sdk.export(handle)``.
    """

    class Handler(exports.Handler):
        def handle(self, msg: _wit.Message) -> None:
            # `random`'s generator was seeded when the component was built, and an
            # instance serves many messages: reseed it from this message, so that a
            # retry draws what the first attempt drew. Not from `os.urandom`: the
            # runtime below it keeps unused bytes across calls (measured: a reused
            # instance read other bytes for the same message). Only if some module
            # imported `random`.
            rnd = sys.modules.get("random")
            if rnd is not None:
                rnd.seed(_host.operation_key("dedupd-sdk:random"))
            try:
                handle(Message(msg))
            except Retryable as e:
                raise Err(_wit.HandlerError_Retryable(str(e)))
            except Permanent as e:
                raise Err(_wit.HandlerError_Permanent(str(e)))

    Handler.__name__ = Handler.__qualname__ = "Handler"
    Handler.__doc__ = handle.__doc__
    return Handler
