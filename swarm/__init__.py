"""swarm: bit-exact sparse RL weight deltas spread peer to peer.

Importing this package is cheap: it pulls in neither torch, libp2p nor vLLM.
Heavy layers (``swarm.delta``, ``swarm.net``, ``swarm.engines``) are imported on use.
"""

from swarm.errors import (
    DecodeError,
    IntegrityError,
    KeyFileError,
    LocalProtocolError,
    RemoteProtocolError,
    SignatureError,
    StoreError,
    SwarmError,
)

__version__ = "0.1.0"

__all__ = [
    "DecodeError",
    "IntegrityError",
    "KeyFileError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "SignatureError",
    "StoreError",
    "SwarmError",
    "__version__",
]
