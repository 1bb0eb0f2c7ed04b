"""specdeck's EAGLE heads against the authors' code: logits of draft steps 1 and 2 and the
EAGLE-2 tree (on both backends), per layout, on golden values tests/fixtures/eagle/make_golden.py
computed with github SafeAILab/EAGLE (cnets.py, cnets1.py) and PyPI eagle-llm."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app.core.feed import StepFeed
from app.core.protocols import TargetOutput
from app.core.types import SamplingParams
from backends.heads.eagle_drafter import EagleDrafter, TargetParts
from tests.eagle_heads import LAYOUTS

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from backends.torch.arrays import TorchArrays  # noqa: E402
from backends.torch.head_weights.eagle import load_eagle_head  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "eagle"
N_LAYERS, HIDDEN, VOCAB = 8, 32, 48


def loaded(layout: str):
    folder = FIXTURES / layout
    golden = load_file(str(folder / "golden.safetensors"))
    kind = "eagle" if layout == "eagle1" else "eagle3"
    head, spec = load_eagle_head(folder, kind=kind, target_name="golden-target",
                                 hidden_size=HIDDEN, vocab_size=VOCAB, n_layers=N_LAYERS)
    return head, spec, golden


def stub_target(golden):
    """The slice of a target an EagleDrafter reads: embedding, output layer, final norm."""
    embed = torch.nn.Embedding.from_pretrained(golden["target_embed"])
    out = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    out.weight.data = golden["target_head"]
    hf = SimpleNamespace(get_input_embeddings=lambda: embed, get_output_embeddings=lambda: out)
    return SimpleNamespace(hf=hf, parts=TargetParts(embed, torch.nn.Identity(), out, VOCAB,
                                                     N_LAYERS))


def features(head, spec, golden):
    if spec.kind == "eagle":
        return [golden["feature"]]
    w = spec.target_hidden_size
    return [golden["states"][:, i * w:(i + 1) * w] for i in range(3)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_steps_one_and_two_match_the_authors_code(layout):
    head, spec, golden = loaded(layout)
    target = stub_target(golden)
    if spec.kind == "eagle":
        head.use_target_head(target.hf.get_output_embeddings())
    embed = head.own_embedding() or target.hf.get_input_embeddings()
    ids = golden["ids"]
    with torch.no_grad():
        hidden = head.project(features(head, spec, golden))[None]
        h, past = head(embed(ids[None, 1:]), hidden, torch.arange(len(ids) - 1)[None])
        logits1 = head.logits(h[0, -1])
        token = head.to_target(logits1.argmax(-1, keepdim=True))
        h2, _ = head(embed(token[None]), head.feedback(h[:, -1:]),
                     torch.tensor([[len(ids) - 1]]), past)
        logits2 = head.logits(h2[0, -1])
    torch.testing.assert_close(logits1, golden["logits1"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits2, golden["logits2"], rtol=1e-4, atol=1e-4)


def mlx_tree_drafter(layout: str):
    """The MLX head of the fixture as a tree drafter over the golden target parts, and the
    captured states it reads."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from backends.mlx.arrays import MlxArrays
    from backends.mlx.head_weights.eagle import load_eagle_head as load_mlx_head

    folder = FIXTURES / layout
    golden = mx.load(str(folder / "golden.safetensors"))
    kind = "eagle" if layout == "eagle1" else "eagle3"
    head, spec = load_mlx_head(folder, kind=kind, target_name="golden-target",
                               hidden_size=HIDDEN, vocab_size=VOCAB, n_layers=N_LAYERS)
    parts = TargetParts(lambda ids: golden["target_embed"][ids], lambda x: x,
                        lambda h: h @ golden["target_head"].T, VOCAB, N_LAYERS)
    drafter = EagleDrafter(head, spec, MlxArrays(mx.default_stream(mx.cpu)), parts, tree=True,
                           top_k=4, max_nodes=16)
    return drafter, features(head, spec, golden)


def torch_tree_drafter(layout: str):
    head, spec, golden = loaded(layout)
    drafter = EagleDrafter(head, spec, TorchArrays("cpu"), stub_target(golden).parts,
                           tree=True, top_k=4, max_nodes=16)
    return drafter, features(head, spec, golden)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_eagle2_tree_is_the_authors_tree(layout, backend):
    """On MLX too: the tree rows' own positions and ancestor mask in the head's attention."""
    drafter, chunks = (torch_tree_drafter if backend == "torch" else mlx_tree_drafter)(layout)
    golden = load_file(str(FIXTURES / layout / "golden.safetensors"))
    # the hook on layer L holds hidden state L + 1: place each chunk where the head reads it
    states = {i - 1: chunk for i, chunk in zip(drafter.spec.hs_ids(N_LAYERS), chunks)}
    ids = [int(t) for t in golden["ids"]]
    first = TargetOutput(argmax=(ids[-1],), hidden_states=states)
    drafter.begin(ids[:-1], StepFeed.prompt(ids[:-1], first, ids[-1]), SamplingParams(),
                  np.random.default_rng(0))
    draft = drafter.propose(ids, 4)  # depth 4 = the reference's 3 expansions after the root
    assert draft.tokens == tuple(golden["tree_tokens"].tolist())
    assert draft.parents == tuple(golden["tree_parents"].tolist())


def test_the_head_speculators_wrote_is_read_with_its_boundary_layer_ids_and_verifier():
    from backends.heads.eagle_format import read_eagle_spec

    spec = read_eagle_spec(FIXTURES / "speculators")
    assert (spec.layout, spec.prefix, spec.own_embed) == ("speculators", "layers.0.", True)
    assert spec.hs_ids(N_LAYERS) == (1, 3, 6) and spec.verifier == "tiny-llama-test"
    assert spec.draft_vocab_size == 16 and not spec.norm_before_residual
