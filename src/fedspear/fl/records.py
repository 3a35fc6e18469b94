"""The wire format of an adapter: one flat float Array per message plus its JSON layout (names, shapes, dtype); the
optional compressed update encodings; and what a message costs on the wire.

Used by the ServerApp, the strategy and the ClientApp alike.

**Bytes on the wire** (``wire_bytes``). Flower 1.41–1.42 moves a Message as a tree of content-addressed objects: the
Message (its metadata), its RecordDict, each record, each Array and the Array's chunks of at most 5 MiB
(``flwr/supercore/inflatable``); the ServerApp, SuperLink and SuperNode push and pull each object's ``deflate()``d
bytes (``push_objects`` / ``pull_objects``) and the message's object tree (``get_object_tree``, protobuf). A
message's wire bytes are those, counted with Flower's own serialisation: identical objects (e.g. all-zero chunks)
count once, as Flower sends them once. Not counted: gRPC/HTTP/TLS framing and the content-free Message header that
the push request repeats beside the objects (a few hundred bytes). Per client, the train message (θ^(t), the config
with the run's settings and the adapter's layout) is counted server → client and its reply (the adapter or the
encoded update, the metrics) client → server. Under simulation nothing is serialised; the figures are what the same
messages take on a deployment's SuperLink ↔ SuperNode link (where the SuperLink stores the broadcast's objects once
for every client, but each SuperNode pulls them).

**Compressed updates** (``update_encoding``; **decision, issue 43**). Flower has no compression mod; this is
fedspear's. ``fp32`` (default) sends the trained adapter θ_k exactly as before. ``fp16`` and ``int8`` send the
*update* Δ_k = θ_k − θ^(t) instead and the server rebuilds θ̂_k = θ^(t) + decode(Δ̂_k) from the θ^(t) it broadcast,
before any check or aggregation. The update, not the adapter, because:

1. the error of both encodings scales with the magnitude encoded: |Δ_k| is far smaller than |θ_k| (one round of a
   few optimiser steps at lr ≈ 2e-4 against LoRA A's initial values of order 1/√d), so encoding θ_k would spend
   the 256 int8 levels on θ^(t)'s range and add errors larger than the update itself;
2. the error is then bounded relative to the update, ‖Δ̂ − Δ‖₂ ≤ ε_enc·‖Δ‖₂ (below), which is the quantity
   aggregation, the server's norm check and differential privacy's clipping reason about; an exact-zero update
   stays exactly zero (θ̂_k = θ^(t) bit for bit);
3. the server already holds θ^(t) exactly (the clients trained from it), so decoding needs nothing extra on the wire.
The broadcast θ^(t) stays fp32: it is the reference both sides add the update to.

- ``fp16``: Δ·2^k cast to IEEE half precision, with one power-of-two exponent k per message chosen so that
  max|Δ|·2^k ∈ (2^13, 2^14] (an exact scaling: no overflow above 65,504 and no loss of relative precision in the
  half-precision subnormals below 2^-14, where real updates at lr 2e-4 lie). Per value |Δ̂ − Δ| ≤ 2^-11·|Δ| + 2^-25·2^-k;
  the second term is ≤ 2^-38·max|Δ|, so ‖Δ̂ − Δ‖₂ ≤ 2^-10·‖Δ‖₂ (``ENCODING_ERROR``) for any adapter below 2^54 values.
  2 bytes per value.
- ``int8``: blockwise absmax int8, as NVFlare's quantisation filters (``nvflare/app_opt/pt/quantization``) and
  bitsandbytes' blockwise 8-bit do, but linear: the flat Δ is cut into blocks of ``INT8_BLOCK`` = 64 values, each
  with one float32 scale s_b ≥ max_b|Δ|/127 (the float32 value of max_b/127, nudged up if rounding took it below),
  q = round(Δ/s_b) ∈ [−127, 127], Δ̂ = q·s_b. Per value |Δ̂ − Δ| ≤ s_b/2; over the whole update, since
  max_b|Δ|² ≤ Σ_{i∈b} Δ_i², ‖Δ̂ − Δ‖₂ ≤ √64/254·‖Δ‖₂ ≈ 0.0315·‖Δ‖₂ (``ENCODING_ERROR``). 1 + 4/64 bytes per value.
  numpy, ~20 lines: bitsandbytes (what NVFlare calls) is a large native dependency built around CUDA, and its
  8-bit code is a non-linear dynamic map without the per-value bound above; no smaller well-kept library does this.

Order under differential privacy: the encoding is the last step on the client. ``encode_update_mod`` is the
outermost mod of the train handler (``@app.train(mods=[encode_update_mod, dp_clipping_mod])``: Flower wraps mods
so that the first listed sees the reply last), so under ``dp = "client"`` it encodes the update that Flower's
``fixedclipping_mod`` has already clipped to C; the Gaussian noise is added by the server to the average
(``fedspear.fl.privacy``), after decoding. A clipped update decodes to norm ≤ C·(1 + ``ENCODING_ERROR``), which the
server's norm check allows for (``reply_norm_bound``); the fixed-denominator mean holds each decoded update to C
again, so the sensitivity C/m the noise is calibrated for is unchanged. Encodings need the packed record (one flat
float32 Array); an adapter that does not pack travels as it is.
"""

from __future__ import annotations

import json
import math

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

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


# ---- compressed updates (module docstring: "Compressed updates") ------------------------------------------------
ENCODINGS = ("fp32", "fp16", "int8")
ENCODING_KEY = "update-encoding"  # in the train config when the server asks for an encoding other than fp32
INT8_BLOCK = 64
FP16_KEYS, INT8_KEYS = ("update-fp16", "update-exponent"), ("update-int8", "update-scales")
# ‖Δ̂ − Δ‖₂ ≤ ENCODING_ERROR[encoding]·‖Δ‖₂ (derivations in the module docstring)
ENCODING_ERROR = {"fp32": 0.0, "fp16": 2.0 ** -10, "int8": math.sqrt(INT8_BLOCK) / 254}


def _packed_flat(record: ArrayRecord, what: str) -> np.ndarray:
    """The flat float32 buffer of a packed record (``to_record``) as float64.

    Raises:
        ValueError: the record is not one flat float32 Array under ``PACKED_KEY``.
    """
    if list(record.keys()) != [PACKED_KEY]:
        raise ValueError(f"update encoding: the {what} is not a packed adapter ({list(record.keys())[:3]})")
    flat = record[PACKED_KEY].numpy()
    if flat.ndim != 1 or flat.dtype != np.float32:
        raise ValueError(f"update encoding: the {what} is {flat.dtype}{list(flat.shape)}, not flat float32")
    return flat.astype(np.float64)


def encode_update(sent: ArrayRecord, trained: ArrayRecord, encoding: str) -> ArrayRecord:
    """The update Δ = trained − sent of two packed records, encoded as ``encoding`` (``fp32``: ``trained`` itself).

    Args:
        sent: θ^(t) as broadcast (``to_record``: one flat float32 Array).
        trained: θ_k packed in the same layout.
        encoding: one of ``ENCODINGS``.
    Returns:
        ``fp16``: ``{"update-fp16": float16[n], "update-exponent": int32[1]}`` (Δ·2^k, k);
        ``int8``: ``{"update-int8": int8[n], "update-scales": float32[⌈n/64⌉]}``. Decode with ``decode_update``.
    Raises:
        ValueError: an unknown encoding, records that are not packed float32, or of different sizes.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"update encoding must be one of {', '.join(ENCODINGS)} (got {encoding!r})")
    if encoding == "fp32":
        return trained
    base, new = _packed_flat(sent, "broadcast adapter"), _packed_flat(trained, "trained adapter")
    if base.size != new.size:
        raise ValueError(f"update encoding: the trained adapter has {new.size} values, the broadcast {base.size}")
    delta = new - base
    if not np.all(np.isfinite(delta)):
        raise ValueError("update encoding: the update has non-finite values")
    if encoding == "fp16":
        peak = float(np.max(np.abs(delta), initial=0.0))
        k = 14 - math.frexp(peak)[1] if peak > 0 else 0  # max|Δ|·2^k in [2^13, 2^14)
        return ArrayRecord({FP16_KEYS[0]: Array(np.ldexp(delta, k).astype(np.float16)),
                            FP16_KEYS[1]: Array(np.array([k], dtype=np.int32))})
    blocks = np.pad(delta, (0, -delta.size % INT8_BLOCK)).reshape(-1, INT8_BLOCK)
    peak = np.max(np.abs(blocks), axis=1)
    scales = (peak / 127).astype(np.float32)
    low = scales.astype(np.float64) * 127 < peak  # float32 rounding took s below max/127: one step up restores it
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    s = scales.astype(np.float64)[:, None]
    q = np.divide(blocks, s, out=np.zeros_like(blocks), where=s > 0)
    q = np.clip(np.rint(q), -127, 127).astype(np.int8).ravel()[:delta.size]
    return ArrayRecord({INT8_KEYS[0]: Array(q), INT8_KEYS[1]: Array(scales)})


def encoding_of(record: ArrayRecord) -> str:
    """Which of ``ENCODINGS`` a reply's ArrayRecord holds (by its keys; anything else counts as ``fp32``)."""
    keys = tuple(record.keys())
    return "fp16" if keys == FP16_KEYS else "int8" if keys == INT8_KEYS else "fp32"


def decode_update(sent: ArrayRecord | None, reply: ArrayRecord) -> ArrayRecord:
    """θ̂_k = θ^(t) + Δ̂ as a packed float32 record (``to_record``'s form) from an encoded reply; a reply that is not
    encoded (``fp32``) is returned as it is.

    Args:
        sent: θ^(t) as broadcast (packed).
        reply: the client's ArrayRecord (``encode_update``'s output, or a plain adapter).
    Raises:
        ValueError: no broadcast (``sent`` None), sizes that do not match it, or an exponent / scales that are not
            finite and sane.
    """
    encoding = encoding_of(reply)
    if encoding == "fp32":
        return reply
    if sent is None:
        raise ValueError(f"{encoding} update: no broadcast adapter to add it to")
    base = _packed_flat(sent, "broadcast adapter")
    if encoding == "fp16":
        values, exponent = reply[FP16_KEYS[0]].numpy(), reply[FP16_KEYS[1]].numpy()
        if values.dtype != np.float16 or values.shape != base.shape or exponent.shape != (1,) \
                or exponent.dtype != np.int32 or not -1100 < int(exponent[0]) < 1100:
            raise ValueError(f"fp16 update: expected float16[{base.size}] and one int32 exponent, got "
                             f"{values.dtype}{list(values.shape)} and {exponent.dtype}{list(exponent.shape)}")
        delta = np.ldexp(values.astype(np.float64), -int(exponent[0]))
    else:
        q, scales = reply[INT8_KEYS[0]].numpy(), reply[INT8_KEYS[1]].numpy()
        blocks = -(-base.size // INT8_BLOCK)
        if q.dtype != np.int8 or q.shape != base.shape or scales.dtype != np.float32 or scales.shape != (blocks,):
            raise ValueError(f"int8 update: expected int8[{base.size}] and float32[{blocks}] scales, got "
                             f"{q.dtype}{list(q.shape)} and {scales.dtype}{list(scales.shape)}")
        if not np.all(np.isfinite(scales)) or np.any(scales < 0):
            raise ValueError("int8 update: scales must be finite and non-negative")
        delta = q.astype(np.float64) * np.repeat(scales.astype(np.float64), INT8_BLOCK)[:base.size]
    decoded = base + delta
    if not np.all(np.isfinite(decoded)):
        raise ValueError(f"{encoding} update: decodes to non-finite values")
    return ArrayRecord({PACKED_KEY: Array(decoded.astype(np.float32))})


def encode_update_mod(msg: Message, context: Context, call_next) -> Message:
    """Client mod: encode the train reply's adapter as the update the server asked for (``ENCODING_KEY`` in the
    train config; absent → fp32, the reply untouched).

    Listed first on the train handler, so it runs after every other mod has changed the reply (``dp_clipping_mod``
    clips first; module docstring). Replies with an error, several ArrayRecords or an adapter that is not packed
    pass unchanged.
    """
    reply = call_next(msg, context)
    config = msg.content.config_records.get("config")
    encoding = str(config[ENCODING_KEY]) if config is not None and ENCODING_KEY in config else "fp32"
    if encoding == "fp32" or reply.has_error():
        return reply
    if len(msg.content.array_records) != 1 or len(reply.content.array_records) != 1:
        return reply
    sent = next(iter(msg.content.array_records.values()))
    key, trained = next(iter(reply.content.array_records.items()))
    if list(sent.keys()) != [PACKED_KEY] or list(trained.keys()) != [PACKED_KEY]:
        return reply
    reply.content[key] = encode_update(sent, trained, encoding)
    return reply


# ---- bytes on the wire (module docstring: "Bytes on the wire") --------------------------------------------------
def wire_breakdown(msg: Message) -> dict[str, int]:
    """A message's wire bytes by part: each record of its content (name → bytes of its deflated objects) and
    ``"message"`` (the Message and RecordDict objects and the object tree). Objects shared by two records count once,
    under the first."""
    seen: set[str] = set()
    parts: dict[str, int] = {}
    for name, record in (msg.content.items() if msg.has_content() else []):
        objects = {k: v for k, v in get_all_nested_objects(record).items() if k not in seen}
        seen.update(objects)
        parts[name] = sum(len(obj.deflate()) for obj in objects.values())
    rest = {k: v for k, v in get_all_nested_objects(msg).items() if k not in seen}
    parts["message"] = sum(len(obj.deflate()) for obj in rest.values()) + get_object_tree(msg).ByteSize()
    return parts


def wire_bytes(msg: Message) -> int:
    """What ``msg`` takes on the wire in bytes: Flower's deflated objects of the message, each distinct one once,
    plus its object tree (module docstring: "Bytes on the wire")."""
    return sum(wire_breakdown(msg).values())
