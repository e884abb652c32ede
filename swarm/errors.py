"""Exception types. Two sides: our own misuse vs. a remote peer's (or a file's) misbehaviour."""


class SwarmError(Exception):
    """Base class of every error this package raises on purpose."""


class LocalProtocolError(SwarmError):
    """The caller misused an API (wrong state, bad argument)."""


class RemoteProtocolError(SwarmError):
    """Input from the network or disk violated the protocol; drop or score the source."""


class DecodeError(RemoteProtocolError):
    """Bytes could not be decoded: malformed, wrong types, over a size bound, unknown version."""


class SignatureError(RemoteProtocolError):
    """A signature is missing, malformed or does not verify against the expected key."""


class IntegrityError(RemoteProtocolError):
    """Content does not hash to the id or root it claims."""


class KeyFileError(SwarmError):
    """A key file is missing, malformed, or readable by group/others."""


class StoreError(SwarmError):
    """The chunk store failed (I/O error, budget exceeded, bad layout)."""


class NodeFailed(SwarmError):
    """A node stopped: one of its tasks failed (the cause is chained), or it was closed
    while a caller waited on it."""
