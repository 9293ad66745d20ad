"""DiffusionGemma (issue 28), first step: the tiny checkpoint in the family's real layout and the reference's goldens
that the family's implementation will be checked against (tests/fixtures/README.md). Until the family is served, a
DiffusionGemma checkpoint is refused with a clear one-line error."""
import json

from click.testing import CliRunner

from tests.conftest import fixture_path

TINY_DG = fixture_path("tiny-diffusion-gemma")


def test_the_fixture_is_a_real_diffusion_gemma_checkpoint():
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(TINY_DG)
    assert type(cfg).__name__ == "DiffusionGemmaConfig"
    with safe_open(TINY_DG / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(".vision_tower." in n for n in names) and any(".experts." in n for n in names)
    gen = json.loads((TINY_DG / "generation_config.json").read_text())
    assert len(gen["eos_token_id"]) == 2


def test_the_goldens_cover_what_the_family_must_reproduce():
    g = json.loads(fixture_path("tiny-diffusion-gemma-golden.json").read_text())
    cases = g["cases"]
    assert len(cases) >= 20 and any(c["ends_with_eos"] for c in cases) and not all(c["ends_with_eos"] for c in cases)
    assert any(len(c["canvas_steps"]) > 1 for c in cases)               # answers spanning several canvases
    assert all(c["decoder_forwards"] == sum(c["canvas_steps"]) for c in cases)
    assert all(set(c["kernels"]) == {"DEFAULT", "AVX2", "AVX512"} for c in g["bf16_cases"])


def test_until_it_is_served_the_checkpoint_is_refused_in_one_line():
    from common.cli import main as cli
    r = CliRunner().invoke(cli, ["generate", "--model-path", str(TINY_DG), "--prompt-ids", "5,6,7", "--device", "cpu"],
                           prog_name="dllm-serve")
    assert r.exit_code == 1 and "DiffusionGemmaForBlockDiffusion" in r.stderr and "not a supported" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
