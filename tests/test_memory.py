"""Memory held only where it is used: a KV cache sized for the pool's whole context costs
resident memory only for the positions written, and the memory bench's split of a process's
pages by kind."""

from __future__ import annotations

import psutil
import torch

from memspec.bench.memory import kind_of, measure
from memspec.procs.decoder.forward.lean import Arch, alloc_cache


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_a_whole_context_cache_is_resident_only_where_written():
    arch = Arch.from_config({"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9,
                             "num_key_value_heads": 3, "num_hidden_layers": 30,
                             "intermediate_size": 1536, "vocab_size": 49152,
                             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                             "rope_theta": 100000.0, "tie_word_embeddings": True})
    before = _rss()
    cache = alloc_cache(arch, 8192, torch.float32, torch.device("cpu"), k_blocked=True)
    nbytes = cache.k.numel() * 4 + cache.v.numel() * 4  # 377 MB for the whole context
    assert not cache.k[:, :, -4:].any() and not cache.v[:, :, -64:].any()  # zeros
    cache.k[:, :, :4] = 1.0  # the first 64 positions of every layer and head
    cache.v[:, :, :64] = 1.0
    grown = _rss() - before
    assert grown < nbytes / 8, (grown, nbytes)
    del cache


def test_pages_are_split_by_kind():
    assert kind_of("[heap]") == "heap" and kind_of("[anon]") == "anonymous"
    assert kind_of("/dev/shm/memspec-p1-slot0") == "slots"
    assert kind_of("/m/model.safetensors") == "model files" and kind_of("/x/a.gguf") == \
        "model files"
    assert kind_of("/usr/lib/libtorch_cpu.so") == "libraries"
    assert kind_of("/usr/lib/x86_64-linux-gnu/libc.so.6") == "libraries"
    m = measure(psutil.Process().pid)
    assert m["pss_mb"] > 0 and m["peak_rss_mb"] >= m["rss_mb"] * 0.9
    assert abs(sum(m["pss_by_kind_mb"].values()) - m["pss_mb"]) < 0.05 * m["pss_mb"] + 2


def test_one_budget_covers_the_kv_cache_and_the_slots() -> None:
    """memory_budget_mb: slots fit beside the KV cache at the whole context; a budget
    below both is one line naming the numbers."""
    import pytest

    from memspec.common.errors import ConfigError
    from memspec.common.memory import slots_for_budget

    mb = 2**20
    assert slots_for_budget(100, 4 * mb, 5, kv_bytes=90 * mb) == 2
    assert slots_for_budget(100, 4 * mb, 5) == 5
    with pytest.raises(ConfigError, match=r"= 60 is too small for one draft slot \(4.0 MB\) "
                                          r"beside the KV cache at max_context \(90.0 MB\)"):
        slots_for_budget(60, 4 * mb, 5, kv_bytes=90 * mb)
