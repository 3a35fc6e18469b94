"""`fedspear bench`'s arithmetic, checked by hand."""

from __future__ import annotations





def test_bench_flop_counts_by_hand():
    """The tiny Llama (hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16, tied 49152-row embedding) with
    LoRA r 4 on all seven projections, counted by hand."""
    from fedspear.experiments.bench import flop_counts, prefill_flops, train_flops
    from fedspear.model import LoraSettings, add_lora, tiny_model

    base, tok = tiny_model(seed=0)
    assert len(tok) == 49152
    model = add_lora(base, LoraSettings(r=4, alpha=8, dropout=0.1))
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64  # q, o; k, v; gate, up, down; two norms
    lora_per_layer = (4 * 64 + 64 * 4) * 2 + (4 * 64 + 32 * 4) * 2 + (4 * 64 + 128 * 4) * 2 + (4 * 128 + 64 * 4)
    counts = flop_counts(model)
    assert counts == {"body": 2 * per_layer + 64, "head": 49152 * 64, "lora": 2 * lora_per_layer, "layers": 2,
                      "width": 64}
    assert counts["body"] == 74_048 and counts["lora"] == 8_192
    # 2 rows × 10 tokens, logits at the last position: 2·(body + lora)·20 + 2·head·2 + 2·layers·width·10·20
    assert prefill_flops(counts, 2, 10) == 2 * 82_240 * 20 + 2 * 3_145_728 * 2 + 2 * 2 * 64 * 10 * 20 == 15_923_712
    assert train_flops(counts, 2, 10, 1) == 2 * 15_923_712 + 2 * 8_192 * 20
