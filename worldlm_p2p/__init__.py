"""WorldLM-P2P: federations of federations for language-model pre-training on hivemind.

Importing the package does nothing beyond defining names (no logging setup, no heavy imports).
Map of the package (``tests/unit/test_layering.py`` checks that it names every module):

Pure math (imports torch only; explicit generators and seeds):

- ``split``: the split of a model's parameters into the shared backbone B and the key layers K.
- ``aggregation``: token-weighted means and the other rules of a region round.
- ``attention``: attentive aggregation of the key layers inside a region.
- ``residual``: residual embeddings of key layers and the cross-region update of a world round.
- ``mixing``: evidence mixing (a member takes only what lowers its loss on its tune slice).
- ``outer_optim``: the outer optimizer of a round (state in, state out).
- ``privacy``: border DP: clipping, Gaussian noise and their accountant.
- ``rounds``: what a region round and a world round compute, for every strategy.
- ``robust``: the robust rule of an all-reduce (clipped mean around the median, weight cap, NaN out).
- ``compression``: what a round's payload becomes on the wire (float32, fp16, uniform 8-bit), per tensor role.
- ``checkpoint``: atomic, self-verifying checkpoints.
- ``codec``: what peers serve each other and checkpoint, as typed records with one decoder each.

Settings and errors (standard library only): ``config/`` (frozen config dataclasses: model,
tokenizer, training, averaging, aggregation, run manifest, peer; one definition per setting),
``kinds`` (the enum-like settings as literal types), ``strategies`` (each strategy as an object:
what it averages, where, what crosses borders; the only place a strategy's name is tested),
``errors`` (user-facing errors).

Layers: ``train/`` (model presets, tokenizer, data, the local inner loop, DP-SGD; no networking),
``net/`` (hivemind DHT, signed records, all-reduce, barrier, leaders, world rounds, the monitor's
view; no transformers/datasets).

Orchestration and tools: ``peer/`` (the one orchestrator that knows every layer, as parts: its
own map), ``bootstrap`` (a
DHT-only bootstrap node), ``swarm`` (a whole world on one machine), ``simulate`` (every strategy in
one process), ``evaluation`` (perplexity of any causal LM on a federated corpus), ``export`` (a
region's model as a Hugging Face directory), ``report`` (loss against tokens, PNG + Markdown),
``report_data`` (the curves and rows a report reads from each source),
``display`` (rich renderables of the swarm's progress), ``logs`` (logging setup for the CLIs; the
library only creates loggers); ``cli/``: thin command-line entry points.
"""

__version__ = "0.1.0"
