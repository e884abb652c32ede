"""State layout: the ordered table of (name, dtype, shape, nbytes) of a model state."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from swarm.content.ids import domain_hash
from swarm.errors import DecodeError
from swarm.wire import strict

DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

MAX_TENSORS = 1 << 16
MAX_NAME_LEN = 512
MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_LAYOUT_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor of a state: its dtype name, shape and size of its raw bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_LEN:
            raise ValueError(f"tensor name must be 1..{MAX_NAME_LEN} characters")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if len(self.shape) > MAX_NDIM or any(
            type(d) is not int or not 0 <= d <= MAX_DIM for d in self.shape
        ):
            raise ValueError(f"bad shape {self.shape!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Ordered tensors of a state, in the trainer's state_dict order. Names are unique."""

    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"a state holds at most {MAX_TENSORS} tensors")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names in a layout must be unique")

    @classmethod
    def of(cls, specs: Sequence[tuple[str, str, Sequence[int]]]) -> StateLayout:
        return cls(tuple(TensorSpec(n, d, tuple(s)) for n, d, s in specs))

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def index(self, name: str) -> int:
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(name)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def encode(self) -> bytes:
        return strict.pack({
            "v": 1,
            "tensors": [[t.name, t.dtype, list(t.shape)] for t in self.tensors],
        })

    @property
    def digest(self) -> bytes:
        return domain_hash("swarm/layout/v1", self.encode())

    @classmethod
    def decode(cls, data: bytes) -> StateLayout:
        """:raises DecodeError: malformed, oversized or unknown-version layout bytes."""
        obj = strict.unpack(data, max_bytes=MAX_LAYOUT_BYTES, max_str=MAX_NAME_LEN,
                            max_array=MAX_TENSORS, max_bin=0)
        m = strict.as_map(obj, frozenset({"v", "tensors"}), "layout")
        if m["v"] != 1:
            raise DecodeError(f"layout: unknown format version {m['v']!r}")
        rows = strict.get_list(m, "tensors", MAX_TENSORS)
        specs = []
        for row in rows:
            if (type(row) is not list or len(row) != 3 or type(row[0]) is not str
                    or type(row[1]) is not str or type(row[2]) is not list):
                raise DecodeError("layout: each tensor is [name, dtype, shape]")
            try:
                specs.append(TensorSpec(row[0], row[1], tuple(row[2])))
            except ValueError as exc:
                raise DecodeError(f"layout: {exc}") from exc
        try:
            return cls(tuple(specs))
        except ValueError as exc:
            raise DecodeError(f"layout: {exc}") from exc
