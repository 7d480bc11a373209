"""The length-generalisation page: its notes (the protocol, how it differs from Ruoss et
al., the peer and the probes) and :func:`render`, which assembles them with the tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from experiments import length_generalization_peer_weights as peer_weights
from experiments import sweep, sweep_page
from experiments.length_generalization_arms import ARMS, REPEAT_RULE, SCALE_TASKS, SPLITS
from experiments.length_generalization_findings import FINDINGS
from experiments.length_generalization_tables import (
    init_probe_section,
    peer_per_seed,
    peer_probe_section,
    peer_section,
    reading,
    same_function_section,
    table,
    time_table,
)

NOTES = {
    "smoke": "Smoke scale: 10 steps of a tiny model on inputs of 1 to 8 symbols, tested at 9, "
    "13 and 17; checks the pipeline only.",
    "cpu": """The `cpu` scale: the protocol's training lengths (1 to 40, drawn per example),
tested at 41 to 161 in steps of 8 with 16 sequences per length; a 3-layer, D = 64, 4-head
model, 2,000 steps of batch 32 at lr 1e-3. Their example trains a 5-layer model for 10,000
steps of batch 128 (the `paper` scale) and evaluates 512 sequences per length.""",
    "paper": """The `paper` scale: their `experiments/example.py` (5 layers, D = 64, 8 heads,
MLP 4 D, dropout 0.1, batch 128, 10,000 steps, Adam lr 1e-3, clip 1), tested at 41 to 500
with 512 sequences per length; meant for an accelerator.""",
}


DIFFERENCES = """How this differs from Ruoss et al.: their model is an encoder (post-norm,
bidirectional attention) that reads the input followed by one empty query per output token and
emits all outputs at once; copejax's is a causal pre-norm decoder that reads `input <sep>
output` and predicts each output token from the true previous ones (teacher forcing; greedy
argmax scored per token, as their accuracy is). Their block's MLP is ReLU with biases and
their output layer a separate linear map; copejax's is its `llama` block (RMSNorm, SwiGLU,
no biases) with the output tied to the token embeddings. Their batches share one length
(drawn per batch); here lengths are drawn per example and padded. Their
`experiments/example.py` trains the randomised relative encoding (`NOISY_RELATIVE`,
Transformer-XL's with randomised positions); copejax's `randomized` arm randomises
sinusoidal absolute positions (its default `encoding`) and, as their code does, samples
positions at evaluation too (`sample_at_eval=True`, one fixed key per evaluation). The
initialisation is theirs: every dense kernel starts at haiku's default, a normal truncated at
two std with std 1 / sqrt(fan_in) (`model.dense_init = "fan_in"`), and the token embeddings
at N(0, 0.02²) times sqrt(D).

Teacher forcing hands the decoder each previous output token, which Ruoss et al.'s encoder
never sees. The accuracy tables therefore carry a floor that needs no model, the *repeat
rule*: guess each output token to be the true one before it, and the first to be the most
frequent first output token (`repeat_rule_accuracy` in `copejax/data/_length_suite.py`,
scored on the study's lengths, data seed 0, at least 64 sequences per length). It sits at
chance (about 50 %) on every task but `bucket_sort`: a sorted output changes symbol at most
four times, so repeating is right on all other tokens, about 95 % at 41 to 161 symbols.
There an arm below the rule does worse past the training lengths than copying the previous
token, which a causal decoder can do at any length.

Published numbers: the paper's results table is not retrievable offline (only its abstract
and introduction are), so no published column is shown."""


INIT_PROBE_NOTE = """## Where the peer and copejax differ: an initialisation probe

Where x-transformers and copejax disagree, the first difference between them is where they
start: the study starts every dense kernel as Ruoss et al.'s code does (truncated normal, std
1 / sqrt(fan_in), 0.125 at D = 64) and multiplies the token embeddings by sqrt(D);
x-transformers keeps torch's defaults (Linear: uniform with std 1 / sqrt(3 fan_in), 0.072 at
D = 64; token embeddings Kaiming normal, std 0.18). The probe trains the arms below again with
`dense_init=normal,init_std=0.072,scale_embeddings=False` (every weight N(0, 0.072²)), the
same seeds and batches; everything else unchanged. If the gap closes, the disagreement is the
initialisation, not the position scheme or a bug."""


PEER_NOTE = """x-transformers 2.31.10 (torch 2.13.0, CPU) trained by
`experiments/length_generalization_peer.py` on the batches copejax's trainer feeds, in the
same order, with the same model sizes, AdamW settings, schedule, clipping, steps and seeds;
scored with the task's own metric. Its block: pre-norm RMSNorm, SwiGLU MLP of copejax's width,
tied embeddings, x-transformers' defaults otherwise (its token embeddings start at Kaiming
normal, std sqrt(2 / D) ≈ 0.18 at D = 64, near copejax's 0.02 · sqrt(D) = 0.16);
`sinusoidal` is its scaled sinusoidal embedding (one learned scale, initialised to
D^-1/2); `rope` rotates half of each head's features (its default `rotary_emb_dim =
dim_head // 2`, 8 of 16 at the `cpu` scale, the full frequency spectrum over those 8), where
copejax rotates all of them (`fraction = 1`); `fox` is its data-dependent ALiBi
(forgetting-transformer gate) with the gate's bias started at 5 (f ≈ 0.993, almost no decay
at first), where copejax starts it at 0 (`forget_bias_init`, f ≈ 0.5). These are
x-transformers' choices and are kept; the parametrisation probe below trains the arms again
with copejax's. Accuracies agree
when the means differ by no more than the larger seed std; each such cell also gives p, the
two-sided exact permutation test of the two sets of seeds (every split of the pooled seeds
into two groups, 252 for five a side, so p ≥ 0.008): a small p says that the two seed sets
differ by more than reshuffling them does, a large one that five seeds cannot tell the two
apart, whatever the std rule says. Step times are medians after five steps, on a shared
machine, and each cell the median over seeds (fastest-slowest seed); torch ran with
{threads}, and as many peer runs at a time as copejax runs (the header says how those were
trained)."""


PEER_PROBE_NOTE = """## Where the peer and copejax differ: a parametrisation probe

x-transformers and copejax's study config build the same function at initialisation (a pre-norm
RMSNorm block with SwiGLU and tied embeddings) but parametrise and start it differently:
x-transformers keeps its token table at Kaiming scale (std 0.18) and multiplies the tied logits
by D^-1/2, where copejax keeps the table at 0.02 and multiplies the embeddings by sqrt(D), so
that Adam's steps, of one size whatever the scale, move copejax's embeddings about 8 times
faster; its linear kernels start at torch's uniform (std 1 / sqrt(3 fan_in)), copejax's at a
truncated normal (std 1 / sqrt(fan_in)); its SwiGLU has biases. The position schemes' own
weights start differently too: x-transformers' sinusoidal table has a learned scale started at
D^-1/2 (copejax adds it at scale 1); its learned table is N(0, 1) read times D^-1/2 (copejax's
N(0, 0.02²) at scale 1); its RoPE rotates half of each head (copejax all of it); its FoX gate
starts with a bias of 5 and torch's uniform kernel (copejax's at 0 and N(0, 0.02²)). ALiBi has
no weights and both CoPE tables start at zero. The probe trains x-transformers again, the same
seeds and batches, with all of copejax's choices (`length_generalization_peer.py
--parametrisation=copejax`). Where it lands on copejax's numbers, the gap between copejax and
x-transformers' defaults is the parametrisation. The check below shows that this network is
copejax's function and trains as copejax's does; where the probe still misses copejax's
spread, only the random draw of the initial weights differs (torch's generator against
JAX's), and the distance shows how far five-seed means move by that draw alone."""


SAME_FUNCTION_NOTE = """### The same function: copejax's weights in the peer

`experiments/length_generalization_peer_weights.py` copies copejax's initial weights (plus
N(0, {noise}²) on every weight, so that the ones that start at zero take part) into
x-transformers in copejax's parametrisation, compares the logits on a batch of random tokens,
and trains both from those weights for {steps} steps on the study's first `{task}` batches
(copejax with optax's AdamW, the peer with torch's). Where logits and losses agree, the two
implementations build and train the same function: a gap between the probe's accuracies and
copejax's is then the random initialisation (torch's generator against JAX's) and the seeds,
not the code."""


def _threads(threads: int) -> str:
    return "its default threads" if threads == 0 else f"{threads} thread(s)"


def render(
    *,
    scale: str,
    tasks: Sequence[str],
    result: sweep.Sweep,
    summary: Mapping[str, Mapping[str, Any]],
    repeat: Mapping[str, Mapping[str, Mapping[str, float]]],
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    probe: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    same: Mapping[str, Mapping[str, Any]],
    init_probe: bool,
    peer_threads: int,
    plot_name: str,
    curve_images: Sequence[str],
    commands: str,
) -> str:
    """The page's markdown: header and notes, the written findings of the recorded runs (at
    the `cpu` scale, every task, with the peer's probe), the accuracy tables, plots and
    reading, step times, then the peer and probe sections that ran (``peer``, ``init_probe``,
    ``probe``, ``same`` empty or false leave theirs out) and ``commands``, the regenerate
    block."""
    findings = scale == "cpu" and tuple(tasks) == SCALE_TASKS["cpu"] and bool(probe)
    return "\n".join(
        [
            sweep_page.header(
                "Length generalisation on the Ruoss et al. 2023 tasks (arXiv 2305.16843)",
                scale,
                result,
                NOTES[scale],
            ),
            DIFFERENCES,
            "",
            *([FINDINGS, ""] if findings else []),
            "## Accuracy on the test lengths",
            "",
            "Per-output-token accuracy of each test length, averaged over the lengths (their "
            "score), last evaluation, mean ± std over seeds.",
            "",
            table(summary, tasks, "long", repeat),
            "",
            f"![accuracy]({plot_name})",
            "",
            reading(summary, tasks, repeat),
            "",
            f"Every seed's accuracy (seeds {', '.join(map(str, result.seeds))}, in that order):",
            "",
            sweep.per_seed_table(result, {f"{s}/accuracy": f"{SPLITS[s]} %" for s in SPLITS}),
            "",
            "Accuracy by input length (mean over seeds, band: one std), last evaluation, with "
            f"the {REPEAT_RULE}:",
            "",
            *curve_images,
            "",
            "## Accuracy on the training lengths",
            "",
            table(summary, tasks, "test", repeat),
            "",
            "## Step time",
            "",
            "Milliseconds per training step (1000 / the median logged steps/s after the "
            "first window), the median over seeds and, in brackets, the fastest and the "
            "slowest seed. Runs train as many at a time as the header says; a run that "
            "trains partly alone (the last of a sweep) reads faster, which the range shows "
            f"and the median leaves out (`{ARMS[-1]}` trains last).",
            "",
            time_table(summary, tasks),
            "",
            "## Peer implementation: x-transformers",
            "",
            PEER_NOTE.format(threads=_threads(peer_threads))
            if peer
            else "Not run yet: the x-transformers (PyTorch) arms on the same "
            "generated data, sizes, steps and seeds (`--peer`).",
            "",
            peer_section(summary, peer, tasks) if peer else "",
            "",
            "Every x-transformers seed's accuracy (the same seeds, in the same order):\n\n"
            + peer_per_seed(peer, tasks)
            if peer
            else "",
            "",
            INIT_PROBE_NOTE + "\n\n" + init_probe_section(result, peer, tasks)
            if init_probe
            else "",
            "",
            PEER_PROBE_NOTE + "\n\n" + peer_probe_section(summary, peer, probe, tasks)
            if probe
            else "",
            "",
            SAME_FUNCTION_NOTE.format(
                noise=peer_weights.NOISE, steps=peer_weights.STEPS, task=tasks[0]
            )
            + "\n\n"
            + same_function_section(same)
            if same
            else "",
            "",
            commands,
        ]
    )
