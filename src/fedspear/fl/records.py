"""The wire format of an adapter: one flat float Array per message plus its JSON layout (names, shapes, dtype).

Used by the ServerApp, the strategy and the ClientApp alike.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord

# One flat Array per message instead of one per tensor: Flower moves every Array (and each of its chunks) as a
# separate object, one HTTP request per hop (SuperLink ↔ SuperNode ↔ ClientApp process, ``flwr/supercore/inflatable``).
# SmolLM2-135M's adapter has 420 tensors: sent one by one they added ~60–90 s to every deployment round on this
# 2-core machine (a round with almost no client work took 106 s; packed, 15–25 s; examples/deploy-local/README.md).
# The layout (names, shapes, dtype) is JSON text in the train message's ConfigRecord, not an Array: until
# 2026-12 it travelled as a uint8 Array beside the buffer, which Flower's DP clipping cannot scale (UFuncTypeError)
# and its noise corrupts (the bytes of the JSON get N(0, σ) added).
PACKED_KEY, LAYOUT_KEY = "adapter", "adapter-layout"


def layout_of(arrays: dict[str, np.ndarray]) -> str | None:
    """The JSON layout of ``to_record(arrays)`` (dtype, then [name, shape] in order); None when the tensors do not
    share one dtype (then each travels as its own Array, named, and needs no layout)."""
    dtypes = {np.asarray(v).dtype for v in arrays.values()}
    if len(dtypes) != 1:
        return None
    return json.dumps({"dtype": str(dtypes.pop()),
                       "tensors": [[name, list(np.shape(v))] for name, v in arrays.items()]})


def to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord holding a *copy* of ``arrays`` (name → ndarray, in order): one flat Array ``"adapter"``.

    Decode it with ``from_record(record, layout_of(arrays))``. Tensors of different dtypes cannot share one buffer;
    then each travels as its own Array (as Flower's own strategies send them).
    """
    if layout_of(arrays) is None:
        return ArrayRecord({k: Array(np.array(v, copy=True)) for k, v in arrays.items()})
    flat = np.concatenate([np.asarray(v).ravel() for v in arrays.values()])  # a new buffer: a copy
    return ArrayRecord({PACKED_KEY: Array(flat)})


def from_record(record: ArrayRecord, layout: str | None = None) -> dict[str, np.ndarray]:
    """name → ndarray copies of an ArrayRecord: packed (``to_record``, decoded with its ``layout``) or one Array per
    tensor (``layout`` None).

    Raises:
        ValueError: a packed record without a layout, a layout that is not valid JSON or does not match the buffer
        (names repeated, negative dimensions, sizes that do not add up, another dtype), or a record holding other
        keys than the packed one.
    """
    if layout is None:
        if list(record.keys()) == [PACKED_KEY]:
            raise ValueError("packed adapter: no layout given to decode it (it travels in the train config)")
        return {k: np.array(v.numpy(), copy=True) for k, v in record.items()}
    if list(record.keys()) != [PACKED_KEY]:
        raise ValueError(f"packed adapter: expected the single Array {PACKED_KEY!r}, got {list(record.keys())[:3]}")
    flat = record[PACKED_KEY].numpy()
    try:
        parsed = json.loads(layout)
        dtype, tensors = parsed["dtype"], [(str(name), tuple(int(d) for d in shape))
                                           for name, shape in parsed["tensors"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"packed adapter: unreadable layout ({err})") from None
    if flat.ndim != 1 or str(flat.dtype) != dtype:
        raise ValueError(f"packed adapter: buffer is {flat.dtype}{list(flat.shape)}, layout says flat {dtype}")
    if len({name for name, _ in tensors}) != len(tensors) or any(d < 0 for _, shape in tensors for d in shape):
        raise ValueError("packed adapter: repeated tensor names or negative dimensions in the layout")
    sizes = [int(np.prod(shape)) for _, shape in tensors]
    if sum(sizes) != flat.size:
        raise ValueError(f"packed adapter: the layout's tensor shapes hold {sum(sizes)} values, the buffer {flat.size}")
    out, start = {}, 0
    for (name, shape), size in zip(tensors, sizes):
        out[name] = flat[start:start + size].reshape(shape).copy()
        start += size
    return out
