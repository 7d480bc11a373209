"""The written reading of the length-generalisation study's `cpu` runs (the ones kept in
``experiments/records``): what the page's tables say, task by task, and what comparing
copejax with x-transformers showed. ``length_generalization_page.render`` puts it at the top
of the `cpu` page of every task with the peer and its probe; the tables below it are
regenerated from the runs, this text is not, so a change of runs asks for a new reading."""

FINDINGS = """## Findings

Trained on lengths 1-40 and scored at 41-161, Ruoss et al.'s initialisation; on six of the seven
tasks (chance 50 %) no scheme generalises.

reverse_string: ALiBi 62.1 % and NoPE 61.7 % highest (the seeds overlap), randomized 60.1 %,
CoPE 59.5 %, FoX 58.6 %, learned 58.3 %, RoPE 57.2 %, sinusoidal 51.7 %; in distribution RoPE
96.4 % and CoPE 96.1 % lead. duplicate_string: the decay-shaped biases lead, ALiBi 70.1 ± 5.2 %
and FoX 65.4 ± 4.2 % (the seeds overlap), then NoPE 61.0 %, randomized 60.2 %, learned 59.2 %,
CoPE 59.1 %, RoPE 53.7 %, sinusoidal 53.2 %; RoPE fits the training lengths best (99.9 %) and
falls to chance past them.

x-transformers agrees within the seed spread on 6 of 14 arm-task pairs (RoPE and ALiBi on
reverse_string; NoPE, ALiBi 71.7 %, CoPE and FoX on duplicate_string); it is ahead on sinusoidal
on both tasks (54.3 %, 55.5 %), on NoPE and FoX on reverse_string and on RoPE on
duplicate_string (54.6 %; its RoPE rotates half of each head), and behind on learned on both
(55.8 %, 57.1 %) and on CoPE on reverse_string (56.2 %). Trained again in copejax's
parametrisation (its embedding scales, init, bias-free MLP and each scheme's own starting
weights, `--peer-probe`), x-transformers lands within copejax's spread on NoPE, sinusoidal, RoPE
and CoPE on both tasks (sinusoidal 50.7 % and 53.4 %; RoPE 53.6 % on duplicate_string, rotating
all of each head; CoPE 59.2 % on reverse_string, against 56.2 % in its defaults) and on learned
and FoX on duplicate_string, and outside it on learned (55.0 %) and FoX (60.5 %) on
reverse_string, next to its own defaults' numbers. With copejax's weights copied in
(`experiments/length_generalization_peer_weights.py`), x-transformers computes copejax's logits
to 5e-6 and its losses to 1e-6 over 20 training steps for every arm: the two build and train the
same function, so the gaps that remain are the random draw of the initial weights, which on
these tasks moves a five-seed mean by up to about 3 points (this page's within-one-std rule
calls that a disagreement).

odds_first: no scheme generalises (NoPE 58.4 %, sinusoidal 52.9 %, the rest 53-57 %);
missing_duplicate: ALiBi 64.6 %, learned 63.1 %, NoPE 63.0 %, FoX 60.9 %, CoPE 57.7 %,
randomized 57.5 %, sinusoidal 54.3 %, RoPE 53.0 % (seeds overlap at the top). On these two tasks
x-transformers agrees within the seed spread on 9 of 14 pairs; its sinusoidal is ahead on both
(56.8 %, 59.6 %; in copejax's parametrisation it lands on copejax's numbers, 53.6 % on
odds_first and 53.7 % on missing_duplicate); its RoPE and FoX are ahead on odds_first by under a
point (54.3 %, 57.5 %; p = 0.095 each) and in copejax's parametrisation land within copejax's
spread (53.6 %, 56.5 %); its learned is behind on missing_duplicate (56.4 % against 63.1 %) and
stays behind in copejax's parametrisation (57.9 ± 2.9 %, gap 5.2, p = 0.063; seeds 52.3-60.2 %
against copejax's 57.8-66.8 %).

parity_check: every arm's mean is at chance past the training lengths (48.5-51.7 %; single seeds
46.5-56.6 %, within about two binomial std of chance for the 256 scored tokens per seed); NoPE
has the highest training-length mean (85.4 %; the other arms 55-77 %), though RoPE passes it on
seed 4 (87.0 % against 83.8 %); x-transformers agrees on all 7 pairs.

binary_addition: no arm fits even the training lengths (means 68-85 %), and past them the best
means are barely above chance: NoPE 54.7 ± 0.3 %, CoPE 54.1 %, learned 53.6 %, randomized 53.2
%, ALiBi 51.9 %, RoPE 51.2 %; sinusoidal (38.5 ± 6.3 %, seeds 27.8-46.1 %) and FoX (42.3 %) have
every seed below the repeat rule (49.0 %). x-transformers agrees within the seed spread on 3 of
its 7 pairs there (NoPE 54.6 %, RoPE 50.6 %, ALiBi 52.8 %); its sinusoidal (51.5 %) and FoX
(52.1 %; its forget gate starts at almost no decay, copejax's at f ≈ 0.5) are ahead and its
learned (52.5 %) and CoPE (52.9 %) a point behind; in copejax's parametrisation sinusoidal (39.8
%), learned (53.6 %) and FoX (41.1 %) land within copejax's spread, sinusoidal and FoX again
with every seed below the repeat rule, and CoPE (53.4 ± 0.5 %) between its defaults and copejax,
0.7 points short of copejax's 54.1 ± 0.6 % (p = 0.13).

bucket_sort (a uniform guess scores 20 %) is the task that separates the schemes, read against a
floor that needs no model: teacher forcing hands the decoder the previous output token, and
repeating it scores 95.3 % on the test lengths, because a sorted output changes symbol at most
four times (this page's *repeat rule*, a row of its tables and a line of its plots). NoPE 98.3 ±
0.7 %, randomized 97.2 % and learned 96.9 % have every seed above that floor, CoPE 95.2 ± 2.9 %
straddles it (seeds 91.6-98.6 %), and RoPE 83.6 %, ALiBi 79.0 %, sinusoidal 75.7 % and FoX 73.8
% have every seed below it (65.0-88.8 %), though every arm fits the training lengths (means
99.4-100 %): past 40 symbols these four lose even the copy of the previous token. The lead of
the top four over the rule shrinks as the inputs grow (this page's bucket_sort plot): at 161
symbols, four times the training lengths, every arm is at or below it (NoPE 96.5 %, randomized
97.2 %, against the rule's 97.5 %). x-transformers agrees on 5 of its 7 pairs there (NoPE 95.7
%, RoPE 80.2 %, ALiBi 77.9 %, CoPE 92.9 %, FoX 77.9 %); its sinusoidal is ahead (89.3 %) and its
learned behind (89.6 %), and in copejax's parametrisation both land within copejax's spread
(83.3 %, 98.3 %).

Over the seven tasks it agrees within the seed spread on 30 of 49 pairs; each of the other 19
was trained again in copejax's parametrisation, and 15 of them then land within copejax's spread
(the four that do not: learned and FoX on reverse_string, learned on missing_duplicate, CoPE on
binary_addition; the largest gap 5.2 points, p ≥ 0.024). Each agreement cell also gives p of the
exact permutation test of the two seed sets (`experiments/permutation_test.py`). This page's
published column is not retrievable offline. Every complete run is kept in
`experiments/records/` (`experiments/run_records.py`), so that a page is regenerated from them
on any machine without training again"""
