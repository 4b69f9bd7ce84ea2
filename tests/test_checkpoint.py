"""Public DFlash checkpoint format: round trips, a hand-written hub-style folder, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.drafting.dflash.config import (
    DFlashConfig,
    default_target_layer_ids,
    load_checkpoint,
    load_config,
    public_param_shapes,
    save_checkpoint,
)
from specdec.drafting.dflash.torch import DFlashDrafter, DFlashDraftModel

# Qwen3-8B-DFlash-b16's config.json, shrunk (hidden 4096 -> 32, 32/8 heads -> 4/2, 36 target layers kept)
HUB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "num_key_value_heads": 2,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=24, vocab_size=50, num_target_layers=6, mask_token_id=49, block_size=4,
        target_layer_ids=(0, 3, 5), layer_types=("sliding_attention", "full_attention"), sliding_window=9,
    )  # fmt: skip
    base.update(kw)
    return DFlashConfig(**base)


def random_state(cfg: DFlashConfig, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in public_param_shapes(cfg).items()}


def write_folder(path, config: dict, state: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return path


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(28, 1) == (14,)
    cfg = tiny_cfg(target_layer_ids=None, num_target_layers=36, num_hidden_layers=5, layer_types=None)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.layer_types == ("full_attention",) * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_bit_identical(tmp_path, dtype):
    cfg = tiny_cfg(extra={"auto_map": {"AutoModel": "x"}})
    model = DFlashDraftModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    drafter = DFlashDrafter(model)
    drafter.save_pretrained(tmp_path / "ckpt")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "ckpt", dtype=dtype)
    assert loaded.cfg == cfg and loaded.cfg.extra == cfg.extra
    a, b = model.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys() == public_param_shapes(cfg).keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype and torch.equal(a[k], b[k]), k
    # and the file itself: saving the loaded drafter again writes the same bytes
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "ckpt/config.json").read_text() == (tmp_path / "again/config.json").read_text()
    assert (tmp_path / "ckpt/model.safetensors").read_bytes() == (
        tmp_path / "again/model.safetensors"
    ).read_bytes()


def test_loaded_drafter_proposes_like_the_saved_one(tmp_path):
    """from_pretrained builds on the meta device: everything not in the state (RoPE) must still be real."""
    cfg = tiny_cfg()
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    emb, head = torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    a = DFlashDrafter(model)
    a.save_pretrained(tmp_path / "ckpt")
    b = DFlashDrafter.from_pretrained(tmp_path / "ckpt")
    feats = torch.randn(7, cfg.feature_dim)
    for d in (a, b):
        d.bind_fns(lambda ids: emb[ids], lambda h: h @ head.T)
        d.extend(feats, list(range(7)))
    torch.testing.assert_close(b.propose_logits(3, 3), a.propose_logits(3, 3), rtol=0, atol=0)


def test_saved_config_is_the_public_format(tmp_path):
    cfg = tiny_cfg()
    save_checkpoint(tmp_path, cfg, random_state(cfg))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["mask_token_id"] == 49
    assert raw["dflash_config"]["target_layer_ids"] == [0, 3, 5]
    assert raw["block_size"] == 4 and raw["num_target_layers"] == 6
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == cfg.rope_theta
    assert raw["layer_types"] == ["sliding_attention", "full_attention"] and raw["sliding_window"] == 9
    qwen3_keys = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size", "attention_bias",
    )  # fmt: skip
    assert set(qwen3_keys) <= raw.keys()


def test_hand_written_hub_folder_loads(tmp_path):
    cfg = DFlashConfig.from_dict(HUB_CONFIG)
    state = random_state(cfg, torch.bfloat16)
    path = write_folder(tmp_path / "Qwen3-8B-DFlash-b16-tiny", HUB_CONFIG, state)
    drafter = DFlashDrafter.from_pretrained(path)
    assert drafter.target_layer_ids == (1, 9, 17, 25, 33)
    assert drafter.mask_token_id == 151669 and drafter.block_size == 16
    assert drafter.feature_dim == 5 * 32 and drafter.vocab_size == 151936
    assert drafter.cfg.rope_theta == 1e6 and drafter.cfg.head_dim == 8
    assert drafter.dtype == torch.float32 and drafter.name == "Qwen3-8B-DFlash-b16-tiny"
    got = drafter.model.state_dict()
    for k, v in state.items():
        assert torch.equal(got[k], v.float()), k
    # unknown keys survive a save (so the written folder still serves where it came from)
    drafter.save_pretrained(tmp_path / "out")
    raw = json.loads((tmp_path / "out/config.json").read_text())
    assert raw["auto_map"] == HUB_CONFIG["auto_map"] and raw["eos_token_id"] == 151645
    assert raw["dtype"] == "float32"  # what is stored now, not the bfloat16 it was read as


def test_transformers5_rope_parameters_and_sliding_config(tmp_path):
    raw = {k: v for k, v in HUB_CONFIG.items() if k != "rope_theta"}
    raw.update(
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        layer_types=["sliding_attention"] * 5, sliding_window=2048,
    )  # fmt: skip
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.rope_theta == 500000.0 and cfg.sliding_window == 2048
    assert cfg.layer_types == ("sliding_attention",) * 5


def test_layer_ids_default_from_fc_width(tmp_path):
    # no target_layer_ids in the config: K comes from fc.weight [H, K*H], ids from the public default
    raw = {k: v for k, v in HUB_CONFIG.items()}
    raw["dflash_config"] = {"mask_token_id": 151669}
    cfg3 = DFlashConfig.from_dict(raw, num_target_features=3)
    path = write_folder(tmp_path / "k3", raw, random_state(cfg3))
    assert load_config(path).target_layer_ids == default_target_layer_ids(36, 3) == (1, 17, 33)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_checkpoint(tmp_path / "a")
    (tmp_path / "a/config.json").write_text(json.dumps(HUB_CONFIG))
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors \(found: \['config.json'\]\)"):
        load_checkpoint(tmp_path / "a")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: s.pop("norm.weight"), r"missing 1 weights: \['norm.weight'\]"),
        (
            lambda s: s.update({"lm_head.weight": torch.zeros(2, 2)}),
            r"unexpected 1 weights: \['lm_head.weight'\]",
        ),
        (
            lambda s: s.update({"fc.weight": torch.zeros(32, 64)}),
            r"fc.weight: \(32, 64\) \(expected \(32, 160\)\)",
        ),
    ],
)
def test_weight_errors(tmp_path, edit, match):
    state = random_state(DFlashConfig.from_dict(HUB_CONFIG))
    edit(state)
    path = write_folder(tmp_path / "bad", HUB_CONFIG, state)
    with pytest.raises(ValueError, match=match):
        DFlashDrafter.from_pretrained(path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.pop("hidden_size"), r"missing \['hidden_size'\]"),
        (lambda c: c.update(dflash_config={"target_layer_ids": [1]}), "dflash_config.mask_token_id"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
        (
            lambda c: c.update(dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 40]}),
            r"\[40\] outside",
        ),
        (lambda c: c.update(layer_types=["sliding_attention"] * 5), "positive sliding_window"),
        (lambda c: c.update(layer_types=["full_attention"] * 4), "4 entries for 5 layers"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4}), "RoPE scaling"),
    ],
)
def test_config_errors(edit, match):
    raw = json.loads(json.dumps(HUB_CONFIG))
    edit(raw)
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_dict(raw)


def test_save_refuses_a_wrong_state(tmp_path):
    cfg = tiny_cfg()
    state = random_state(cfg)
    state.pop("layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing 1 weights: \['layers.1.mlp.up_proj.weight'\]"):
        save_checkpoint(tmp_path, cfg, state)
    assert not (tmp_path / "model.safetensors").exists()


def test_draft_vocabulary_round_trip(tmp_path):
    """The draft vocabulary lives in config.json: the weights stay exactly the public set."""
    cfg = tiny_cfg(draft_vocab=[0, 2, 4, 6, 8])
    DFlashDrafter(DFlashDraftModel(cfg)).save_pretrained(tmp_path / "ckpt")
    text = (tmp_path / "ckpt/config.json").read_text()
    assert '"draft_vocab": [0, 2, 4, 6, 8]' in text  # one line
    assert json.loads(text)["dflash_config"]["draft_vocab"] == [0, 2, 4, 6, 8]
    assert set(load_file(str(tmp_path / "ckpt/model.safetensors"))) == set(public_param_shapes(cfg))
    loaded = DFlashDrafter.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert loaded.cfg == cfg and loaded.model.draft_vocab.dtype == torch.int64
    assert loaded.model.draft_vocab.tolist() == [0, 2, 4, 6, 8]
    for bad, match in (([0, 2, 2], "repeated"), ([0, 10**6], "must lie"), ([], "empty")):
        with pytest.raises(ValueError, match=match):
            tiny_cfg(draft_vocab=bad)


# ---- RoPE scaling (Qwen3.6 drafters: YaRN) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "truncate": False},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
         "mscale": 1.0, "mscale_all_dim": 0.707},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
         "attention_factor": 1.5},
    ],
)  # fmt: skip
def test_rope_frequencies_are_transformers_own(scaling):
    """The drafters' RoPE frequencies and cos/sin factor equal transformers' own for each scaling type."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specdec.drafting.rope import rope_frequencies

    raw = {**tiny_cfg().to_dict(), "rope_scaling": scaling}
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.rope_scaling == scaling and DFlashConfig.from_dict(cfg.to_dict()) == cfg  # round trip
    hf = transformers.Qwen3Config(
        head_dim=cfg.head_dim, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_theta": cfg.rope_theta, **scaling},
    )  # fmt: skip
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    inv, scale = rope_frequencies(cfg)
    torch.testing.assert_close(torch.tensor(inv, dtype=torch.float32), inv_hf, rtol=1e-6, atol=0)
    assert scale == pytest.approx(scale_hf, rel=1e-7)


def test_unsupported_rope_is_refused_in_one_line():
    for bad, match in (
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
        ({"rope_type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
        ({"rope_type": "linear"}, "needs a positive 'factor'"),
    ):
        with pytest.raises(ValueError, match=match):
            DFlashConfig.from_dict({**tiny_cfg().to_dict(), "rope_scaling": bad})
