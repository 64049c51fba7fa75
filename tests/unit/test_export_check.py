"""`--check-config --export-family F` (issue #43 item 10): a config that export-hf would refuse
(a shared expert on a Qwen3-MoE shape) is found before training: one line naming why and the
families it does export to, exit 2; an exportable one names the family export-hf writes."""
import pytest

from megatron_moe.model.bert import BertMoEModel
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.training.entry import main

QWEN3 = ["--check-config", "--config", "configs/qwen3_moe_tiny.yaml"]


@pytest.fixture(autouse=True)
def in_checkout(monkeypatch, request):
    monkeypatch.chdir(request.config.rootpath)
    for var in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)


def check(capsys, model, argv):
    code = main(model, argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_an_unexportable_config_is_one_line_and_exit_2(capsys):
    shared = QWEN3 + ["moe.shared_expert_ffn_hidden_size=64"]
    for family, picked in (("qwen3_moe", ""), ("auto", " (the family export-hf picks for this shape)")):
        code, out, err = check(capsys, GPTMoEModel, shared + ["--export-family", family])
        assert code == 2 and out == "", (out, err)
        assert err == (f"config error: cannot export to qwen3_moe{picked}: not Qwen3MoeForCausalLM-shaped: "
                       "moe.shared_expert_ffn_hidden_size (Qwen3-MoE has no shared expert); this config exports "
                       "to no family\n")
    code, out, err = check(capsys, GPTMoEModel, QWEN3 + ["--export-family", "mixtral"])
    assert code == 2 and err == ("config error: cannot export to mixtral: not MixtralForCausalLM-shaped: "
                                 "model.qk_norm=head (Mixtral has no QK-norm); this config exports to qwen3_moe\n")
    code, out, err = check(capsys, GPTMoEModel, QWEN3 + ["--export-family", "llama"])
    from megatron_moe.convert.hf_families import FAMILIES  # every family export-hf writes, sorted

    assert code == 2 and err == ("config error: --export-family llama: not a family export-hf writes "
                                 f"(one of {', '.join(sorted(FAMILIES))}, or auto)\n")
    code, out, err = check(capsys, BertMoEModel, ["--check-config", "--config", "configs/bert_moe_tiny.yaml",
                                                  "--export-family", "auto"])
    assert code == 2 and err == ("config error: BertMoEModel exports to no Hugging Face family (only GPT-MoE "
                                 "models do; docs/checkpoints.md)\n")


def test_an_exportable_config_names_its_family(capsys):
    for family in ("auto", "qwen3_moe"):
        code, out, err = check(capsys, GPTMoEModel, QWEN3 + ["--export-family", family])
        assert code == 0 and err == "", err
        assert out.splitlines()[0] == "export ok: export-hf --family qwen3_moe accepts it"
        assert "config ok: configs/qwen3_moe_tiny.yaml on 1 process" in out
    code, out, err = check(capsys, GPTMoEModel, QWEN3)  # without the flag: no export check, no line
    assert code == 0 and "export" not in out
    with pytest.raises(SystemExit) as e:
        main(GPTMoEModel, ["--config", "configs/qwen3_moe_tiny.yaml", "--export-family", "auto"])
    assert e.value.code == 2 and "--export-family F goes with --check-config" in capsys.readouterr().err


def test_help_names_every_export_family(capsys):
    """`--help` lists every family export-hf writes (a help text naming fewer is stale)."""
    from megatron_moe.config.load import parse_cli
    from megatron_moe.convert.hf_families import FAMILIES
    with pytest.raises(SystemExit):
        parse_cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in FAMILIES), text
