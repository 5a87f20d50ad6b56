"""`jaxserve train-draft` on the tiny Llama (its lm_head scaled up so that its next-token
distributions have a clear top-1): the loss goes down on a repetitive dataset, a
resumed run ends where an uninterrupted one does, the written head loads with
eagle3.load_head and keeps the engine's greedy output; the TTT attention matches a
per-position reference; the draft vocabulary and bad input."""

import json
import os
import random
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import cli
from jaxserve.spec_decode.pacing import DraftPacing
from jaxserve.models import loader, registry
from jaxserve.spec_decode import eagle3
from jaxserve.train_draft import data, head
from tests.conftest import GOLDEN_DIR

TINY = os.path.join(GOLDEN_DIR, "ckpt", "llama")
COMMON = ["--aux-layers", "0,1,1", "--max-len", "64", "--batch-size", "4", "--draft-vocab-size", "96",
          "--lr", "3e-3", "--warmup-steps", "2"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny Llama with lm_head x 10: peaked distributions, a clear top-1."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path_factory.mktemp("target")
    shutil.copy(os.path.join(TINY, "config.json"), path / "config.json")
    tensors = load_file(os.path.join(TINY, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 10
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Token-id records, each one of three 5-token patterns (from a random place in it)
    repeated: the held-out records' contexts are ones training saw, so what the head
    learned shows there too. (A random target's top-1 depends on its whole context: records
    of patterns it never saw would need far more data than a test can take.)"""
    rng = random.Random(0)
    patterns = [[rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
    path = tmp_path_factory.mktemp("data") / "rep.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            p, o = patterns[i % 3], rng.randrange(5)
            f.write(json.dumps({"input_ids": ((p[o:] + p[:o]) * 16)[:rng.randrange(32, 64)]}) + "\n")
    return str(path)


def train_draft(target, dataset, out, *extra) -> int:
    return cli.main(["train-draft", target, "--dataset", dataset, "--output", str(out), *COMMON, *extra])


def log_of(out) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def perturbed_head(cfg, params, draft_ids) -> head.Eagle3Head:
    """A fresh head with every Param moved off its initial value (unit norms included)."""
    from jaxserve.models import llama

    h = head.init_head(cfg, params, llama, draft_ids, seed=1)
    nnx.update(h, jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.PRNGKey(2), a.shape),
                               nnx.state(h, nnx.Param)))
    return h


def test_loss_goes_down_the_head_runs_in_the_engine_and_the_walk_predicts_its_acceptance(
        target, dataset, tmp_path, monkeypatch):
    """One training run (two before, each compiling the trainer's and the engine's programs)
    on the target's own greedy replies: the loss goes down; the written head is the HF EAGLE3
    format the engine loads and keeps its greedy output; walking the held-out chain lengths as
    the engine drafts (train.walk_acceptance) gives exactly the engine's measured mean
    acceptance length: the trained head and the engine's head agree at every chained step (a
    wrong position, token or cache entry anywhere would change which drafts are kept)."""
    out = tmp_path / "head"
    # NOTE: the walk is the pipelined core's chain. Paced by acceptance (spec_decode/pacing.py)
    # the core waits at low acceptance, and its mean length then differs (1.590 against the
    # walk's 1.602 here, greedy output the same): a difference not yet explained (issue 67)
    monkeypatch.setattr(DraftPacing, "pipelines", lambda self, running: True)
    assert train_draft(target, dataset, out, "--regenerate", "--regenerate-seqs", "8", "--num-steps", "60",
                       "--log-every", "5", "--num-eval", "6", "--eval-prompts", "6",
                       "--eval-max-tokens", "24") == 0
    losses = [r["loss"] for r in log_of(out)]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0], losses
    report = json.load(open(out / "report.json"))
    engine, held = report["engine"], report["held_out"]
    assert len(held["acceptance_per_position"]) == 3 and held["positions"] > 0
    assert held["acceptance_per_position"][0] > 0.25, held
    assert held["mean_acceptance_length_estimate"] == pytest.approx(1 + sum(held["acceptance_per_position"]))
    assert engine["greedy_equal"] is True and engine["eagle3"] > 1.2 and engine["ngram"] is not None, engine
    assert engine["eagle3_walk_estimate"] == pytest.approx(engine["eagle3"]), engine
    # Every position's estimate over-states the walk's: the walk lingers where drafts miss.
    assert held["mean_acceptance_length_walk"] < held["mean_acceptance_length_estimate"]
    # The written head is the HF EAGLE3 format the engine loads, its d2t the draft vocabulary.
    cfg = loader.load_model(target, dtype="float32")[0]
    head_cfg, params, aux = eagle3.load_head(str(out), cfg, "float32")
    assert aux == (0, 1, 1) and head_cfg.hidden_size == cfg.hidden_size
    ids = np.asarray(params["draft_to_target"])
    assert len(ids) == 96 and (np.diff(ids) > 0).all()


def test_resume_ends_where_an_uninterrupted_run_does(target, dataset, tmp_path):
    args = ["--num-steps", "10", "--save-every", "5", "--log-every", "5", "--num-eval", "0"]
    assert train_draft(target, dataset, tmp_path / "a", *args) == 0
    # Out of time after its first step: that step is checkpointed and a head written anyway.
    assert train_draft(target, dataset, tmp_path / "b", *args, "--max-train-minutes", "0") == 0
    assert json.load(open(tmp_path / "b" / "report.json"))["steps"] == 1
    assert os.listdir(tmp_path / "b" / "checkpoints") == ["1"]
    assert train_draft(target, dataset, tmp_path / "b", *args, "--resume") == 0
    assert [r["step"] for r in log_of(tmp_path / "b")] == [1, 5, 10]
    from safetensors.numpy import load_file

    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "b"))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # Without --resume, a directory with checkpoints is refused rather than overwritten.
    assert train_draft(target, dataset, tmp_path / "a", *args) == 1


def test_ttt_step_zero_is_the_engines_head(target, tmp_path):
    """Step 0 of the training forward predicts what eagle3.head_forward (the engine's,
    paged) predicts from the exported head, at every position."""
    from jaxserve.models import llama
    from jaxserve.train_draft import target as target_mod
    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    cfg, params, _ = loader.load_model(target, dtype="float32")
    draft_ids = np.arange(0, 256, 2, dtype=np.int32)
    h = perturbed_head(cfg, params, draft_ids)
    tokens = np.asarray([[5, 9, 33, 7, 100, 42, 8, 8, 19, 3, 77, 61, 12, 200, 4, 90]], np.int32)
    aux, _, _, _ = target_mod.make_target_fn(llama, cfg, (1, 0, 1))(params, jnp.asarray(tokens), jnp.asarray(draft_ids))
    logits = h(params["embed"], aux, jnp.asarray(tokens), 2)
    ours = draft_ids[np.asarray(jnp.argmax(logits[0][0], -1))]
    head.export_head(str(tmp_path), h, (1, 0, 1))
    head_cfg, hparams, _ = eagle3.load_head(str(tmp_path), cfg, "float32")
    tables = scattered_block_tables(1, 8, 16, seed=0)
    x = build_step([Chunk(0, tokens[0, 1:].tolist(), 0)], tables, 4, 16, 1)
    kv = {n: jnp.zeros((16, 4, *s)) for n, s in llama.cache_specs(head_cfg)[0].arrays}
    _, ids, _ = eagle3.head_forward(head_cfg, hparams, kv, x, params["embed"], aux[0],
                                    llama.make_kernels(head_cfg))
    np.testing.assert_array_equal(ours[:15], np.asarray(ids)[:15])


def test_ttt_attention_matches_a_per_position_reference():
    """Step i's query at t attends to step 0's keys at <= t and to steps 1..i's keys at t."""
    rng = np.random.default_rng(0)
    b, t, n, kh, e, steps = 2, 5, 4, 2, 8, 3
    q = rng.standard_normal((b, t, n, e)).astype(np.float32)
    keys = [rng.standard_normal((b, t, kh, e)).astype(np.float32) for _ in range(steps)]
    values = [rng.standard_normal((b, t, kh, e)).astype(np.float32) for _ in range(steps)]
    got = np.asarray(head.ttt_attention(jnp.asarray(q), keys, values, 0.3)).reshape(b, t, n, e)
    for bi in range(b):
        for ti in range(t):
            for hi in range(n):
                g = hi // (n // kh)
                ks = np.concatenate([keys[0][bi, :ti + 1, g]] + [k[bi, ti:ti + 1, g] for k in keys[1:]])
                vs = np.concatenate([values[0][bi, :ti + 1, g]] + [v[bi, ti:ti + 1, g] for v in values[1:]])
                s = ks @ q[bi, ti, hi] * 0.3
                p = np.exp(s - s.max())
                np.testing.assert_allclose(got[bi, ti, hi], (p / p.sum()) @ vs, rtol=1e-5, atol=1e-5)


def test_draft_vocab_is_the_most_frequent_tokens():
    ex = [data.Example(np.asarray([7, 7, 7, 3, 3, 9, 1], np.int32), 3)]
    np.testing.assert_array_equal(data.draft_vocab(ex, 12, 3), [1, 3, 7])    # 1 and 9 tie: the lower id
    np.testing.assert_array_equal(data.draft_vocab(ex, 12, 6), [0, 1, 2, 3, 7, 9])
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 12\]"):
        data.draft_vocab(ex, 12, 13)


def test_bad_input_is_refused(target, tmp_path, capsys):
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "no tokenizer for this"}) + "\n")
    aux = ["--aux-layers", "0,1,1"]
    assert cli.main(["train-draft", target, "--dataset", str(text), "--output", str(tmp_path / "o"), *aux]) == 1
    assert "has no tokenizer" in capsys.readouterr().err
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"prompt": [1, 2, 3, 4]}) + "\n")
    assert cli.main(["train-draft", target, "--dataset", str(odd), "--output", str(tmp_path / "o"), *aux]) == 1
    assert "needs 'conversations', 'messages', 'text' or 'input_ids'" in capsys.readouterr().err
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [1, 2, 3, 4, 5]}) + "\n")
    assert cli.main(["train-draft", target, "--dataset", str(ids), "--output", str(tmp_path / "o"),
                     "--aux-layers", "0,1,2"]) == 1
    assert "--aux-layers must be three layers of the target (0 to 1)" in capsys.readouterr().err
    assert cli.main(["train-draft", target, "--dataset", str(ids), "--output", str(tmp_path / "o"),
                     *aux, "--max-len", "40"]) == 1
    assert "--max-len must be a multiple of 16; got 40" in capsys.readouterr().err


def test_sharegpt_records_render_with_the_chat_template():
    class Tok:
        def apply_chat_template(self, msgs, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + ("<assistant>" if add_generation_prompt else "")

        def encode(self, text):
            return [ord(c) for c in text]

    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    ex = data.tokenize_record(rec, Tok(), 64)
    assert "".join(map(chr, ex.token_ids)) == "<user>hi<assistant>hello"
    assert ex.prompt_len == ex.train_from == len("<user>hi<assistant>")     # the loss: the reply only
    assert data.tokenize_record({"conversations": [{"from": "gpt", "value": "x" * 9}]}, Tok(), 64) is None


def test_regenerate_replaces_replies_by_the_targets_greedy_ones(target):
    from jaxserve.models import llama
    from jaxserve.train_draft.evaluate import make_llm
    from jaxserve.train_draft.regenerate import regenerate

    cfg, params, _ = loader.load_model(target, dtype="float32")
    llm = make_llm(cfg, params, None, registry.LLAMA, "float32", None, 32, 4)
    ex = [data.Example(np.arange(10, 30, dtype=np.int32), 6), data.Example(np.arange(40, 52, dtype=np.int32), 11)]
    new = regenerate(llm, ex, 32, use_tqdm=False)
    from jaxserve import SamplingParams

    for e, n in zip(ex, new):
        want = llm.generate({"prompt_token_ids": e.token_ids[:e.prompt_len].tolist()},
                            SamplingParams(temperature=0, max_tokens=32 - e.prompt_len), use_tqdm=False)
        assert n.prompt_len == e.prompt_len and len(n.token_ids) <= 32
        assert n.token_ids[:e.prompt_len].tolist() == e.token_ids[:e.prompt_len].tolist()
        assert n.token_ids[e.prompt_len:].tolist() == list(want[0].outputs[0].token_ids)


def test_resume_reads_back_the_regenerated_examples(target, dataset, tmp_path, monkeypatch):
    out = tmp_path / "regen"
    args = ["--regenerate", "--regenerate-seqs", "4", "--num-steps", "4", "--save-every", "2",
            "--log-every", "2", "--num-eval", "3", "--eval-prompts", "0", "--max-examples", "12"]
    assert train_draft(target, dataset, out, *args, "--max-train-minutes", "0") == 0
    first = json.load(open(out / "report.json"))
    with open(out / "regenerated.jsonl") as f:
        splits = [json.loads(line)["split"] for line in f]
    assert splits.count("train") == first["train_examples"] and splits.count("held_out") == 3
    # --resume trains on the saved examples: the target is not asked to generate them again.
    from jaxserve.train_draft import regenerate

    def refuse(*a, **k):
        raise AssertionError("regenerated again on --resume")

    monkeypatch.setattr(regenerate, "regenerate", refuse)
    assert train_draft(target, dataset, out, *args, "--resume") == 0
    again = json.load(open(out / "report.json"))
    assert again["steps"] == 4 and again["train_examples"] == first["train_examples"]
    assert again["held_out"]["positions"] == first["held_out"]["positions"]


def test_training_leaves_out_the_held_out_prompts():
    ex = lambda ids, p: data.Example(np.asarray(ids, np.int32), p, p)
    held = [ex([1, 2, 3, 9, 9], 3)]
    train = [ex([1, 2, 3, 7, 7], 3), ex([1, 2, 3, 4, 9], 4), ex([5, 2, 3, 9, 9], 3)]
    assert data.drop_held_out_prompts(train, held) == train[1:]     # same prompt, another reply too


def test_walk_acceptance_visits_positions_as_the_engine_does():
    from jaxserve.train_draft.train import walk_acceptance

    # Prompt of 2 tokens, 10 in all: drafts from t = 1 (kept 3: next at t = 5), then t = 5
    # (its limit is 10 - 8 = 2 drafts, kept 2), then t = 8 cannot draft (no room).
    kept = np.asarray([[0, 3, 0, 0, 0, 3, 1, 1, 3, 3]])
    assert walk_acceptance(kept, [10], [2]) == (5, 2)
    assert walk_acceptance(kept, [10], [2], max_new=5) == (3, 1)       # end 7: t = 5 has no room
    assert walk_acceptance(np.zeros((1, 10), int), [10], [2]) == (0, 6)  # t = 1 .. 6, one token each


def test_the_targets_outputs_are_the_same_with_the_pallas_attention(target):
    """The GPU default (--attention-impl auto: the Pallas kernel) gives the trainer what the
    XLA attention does (interpret mode here), over a batch of rows of different lengths."""
    from jaxserve.models import llama
    from jaxserve.train_draft import target as target_mod

    cfg, params, _ = loader.load_model(target, dtype="float32")
    draft_ids = jnp.arange(0, 256, 2, dtype=jnp.int32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 256, (3, 32)), jnp.int32)
    ref, got = (target_mod.make_target_fn(llama, cfg, (0, 1, 1), impl)(params, tokens, draft_ids)
                for impl in ("xla", "pallas"))
    for name, r, g in zip(("aux", "logits", "top1", "in_draft"), ref, got):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-5, atol=2e-5, err_msg=name)


def test_the_loss_is_on_the_replies_only(target):
    """A row's positions count in the loss and the agreement figures only where they predict a
    token at or after its train_from (records without a prompt/reply split: every token)."""
    from jaxserve.models import llama
    from jaxserve.train_draft import target as target_mod
    from jaxserve.train_draft import train

    assert data.tokenize_record({"input_ids": list(range(3, 13)), "prompt_len": 4}, None, 64).train_from == 4
    assert data.tokenize_record({"input_ids": list(range(3, 13))}, None, 64).train_from == 0
    cfg, params, _ = loader.load_model(target, dtype="float32")
    draft_ids = np.arange(0, 256, 2, dtype=np.int32)
    h = head.init_head(cfg, params, llama, draft_ids, seed=1)
    ex = [data.Example(np.arange(10, 30, dtype=np.int32), 6, 6), data.Example(np.arange(40, 52, dtype=np.int32), 5, 0)]
    b = data.make_batch(ex, 2, 32)
    ids = jnp.asarray(b.token_ids)
    tgt = target_mod.make_target_fn(llama, cfg, (0, 1, 1))(params, ids, jnp.asarray(draft_ids))
    batch = (tgt[0], ids, jnp.asarray(b.lengths), jnp.asarray(b.train_from), *tgt[1:])
    sums = np.asarray(train.make_eval_step(2)(h, params["embed"], batch)[0])
    # step i at t is valid while t + 1 + i < length and t + 2 + i >= train_from
    want = [sum(1 for t in range(32) if t + 1 + i < 20 and t + 2 + i >= 6) +
            sum(1 for t in range(32) if t + 1 + i < 12) for i in range(2)]
    np.testing.assert_array_equal(sums[:, 3], want)
    assert (sums[:, 1] <= sums[:, 3]).all()


def test_the_bf16_head_follows_the_f32_one(target):
    """--head-dtype bfloat16 (the GPU default) computes the same logits as float32 to bf16's
    precision, and its gradients are f32 like its parameters."""
    cfg, params, _ = loader.load_model(target, dtype="float32")
    h = perturbed_head(cfg, params, np.arange(0, 256, 2, dtype=np.int32))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 256, (2, 16)), jnp.int32)
    aux = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 3 * cfg.hidden_size))
    f32, bf16 = (h(params["embed"], aux, tokens, 3, dt) for dt in (jnp.float32, jnp.bfloat16))
    for a, b in zip(f32, bf16):
        assert b.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(a)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.03 * scale)
        assert float(jnp.max(jnp.abs(a - b))) > 0          # it did compute in bf16
    grads = nnx.grad(lambda m: sum(jnp.sum(x) for x in m(params["embed"], aux, tokens, 2, jnp.bfloat16)))(h)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
