"""Model configs: presets, the released K3 numbers, validation errors that name the field."""

import dataclasses
import json

import pytest

from kda.layer import KDAConfig
from models.config import (PRESETS, ModelConfig, count_params, format_count, preset,
                           released_k3_json)
from moe.config import MoEConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_counted(name):
    cfg = preset(name)
    counts = count_params(cfg)
    assert 0 < counts["active"] <= counts["total"]
    assert counts["embedding"] == cfg.d_model * cfg.vocab_size
    parts = ("kda", "mla", "moe", "dense_ffn", "norms", "attn_res", "lm_head")
    assert counts["total"] == sum(counts[p] for p in parts)
    assert len(cfg.mixer_kinds) == cfg.num_layers


def test_k3_matches_the_released_report():
    counts = count_params(preset("k3"))
    # The K3 report: 2.78T total, 104.2B active per token (input embedding excluded).
    assert counts["total"] == pytest.approx(2.778e12, rel=5e-3)
    assert counts["active"] == pytest.approx(104.2e9, rel=5e-3)
    assert format_count(counts["total"]) == "2.778T"
    assert format_count(counts["active"]) == "104.190B"


def test_k3_layer_schedule():
    cfg = preset("k3")
    kinds = cfg.mixer_kinds
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert kinds[:4] == ("kda", "kda", "kda", "mla") and kinds[-2:] == ("mla", "mla")
    assert cfg.ffn_kinds.count("dense") == 1 and cfg.ffn_kinds[0] == "dense"
    assert cfg.seal_period == 24  # sub-layers: 12 transformer layers


def test_kimi_linear_size():
    counts = count_params(preset("kimi_linear_48b"))
    # Released as "48B total, 3B activated" (rounded); the config gives 48.7B and 3.1B.
    assert 48e9 <= counts["total"] <= 49e9
    assert 3.0e9 <= counts["active"] <= 3.2e9


def test_one_b_is_about_one_billion_active_in_multiples_of_128():
    cfg = preset("1b")
    assert count_params(cfg)["active"] == pytest.approx(1e9, rel=0.05)
    dims = (cfg.d_model, cfg.dense_hidden, cfg.vocab_size, cfg.moe.expert_hidden,
            cfg.moe.latent_dim, cfg.moe.shared_hidden, cfg.kda.head_dim, cfg.mla.q_lora_rank,
            cfg.mla.kv_lora_rank, cfg.mla.num_heads * cfg.mla.v_head_dim)
    assert all(d % 128 == 0 for d in dims)


def test_small_is_about_100m():
    assert count_params(preset("small"))["total"] == pytest.approx(100e6, rel=0.1)


def test_k3_preset_equals_the_released_config_file(tmp_path):
    released = released_k3_json()
    assert ModelConfig.from_hf_config(released["text_config"],
                                      released["vision_config"]) == preset("k3")
    assert ModelConfig.from_hf_config(released["text_config"]) == preset("k3", vision=None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(released))
    assert ModelConfig.from_json(path) == preset("k3")


def test_preset_overrides_and_unknown_name():
    assert preset("tiny", scan_layers=True).scan_layers
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(kda_layers=(1, 2, 5), full_attn_layers=(4,)), "kda_layers"),
        (dict(kda_layers=(1, 2, 3), full_attn_layers=(0, 4)), "full_attn_layers"),
        (dict(kda_layers=(1, 2, 3, 4), full_attn_layers=(4,)), "full_attn_layers"),
        (dict(kda_layers=(1, 2), full_attn_layers=(4,)), "kda_layers"),
        (dict(first_k_dense=5), "first_k_dense"),
        (dict(residual="highway"), "residual"),
        (dict(dtype="int8"), "dtype"),
        (dict(remat="sometimes"), "remat"),
        (dict(d_model=0), "d_model"),
    ],
)
def test_bad_model_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        preset("tiny", **overrides)


def test_nested_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_value_heads"):  # heads that do not divide
        dataclasses.replace(preset("tiny").kda, num_value_heads=3)
    with pytest.raises(ValueError, match="top_k"):  # top-k above the expert count
        MoEConfig(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="num_heads"):
        KDAConfig(num_heads=0, head_dim=8)
