"""Typed configuration: one dataclass per hydra group, converted once at the entry point.

Library code receives these dataclasses and never touches an OmegaConf object. `build_config`
validates every key and type and raises `ConfigError` naming the dotted key, so a typo on the
command line (`train.epoch=3`) fails at start-up instead of being silently ignored.

Every field is documented here, once, by the comment on the line(s) directly above it and/or the comment
trailing it; tools/config_reference.py turns these comments into docs/config.md (tests/unit/test_config_docs.py
fails on a field without one, and on a docs/config.md that no longer matches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from xc.ann.base import AnnParams
from xc.config_checks import convert, validate
from xc.errors import ConfigError


@dataclass(frozen=True)
class SyntheticConfig:
    """Generator parameters (see xc.data.synthetic): Zipf labels, per-label feature signatures."""

    num_train: int = 20000  # training points generated
    num_test: int = 5000  # test points generated
    num_labels: int = 10000  # labels L
    num_features: int = 20000  # feature vocabulary F (signature and background words)
    avg_labels: float = 5.0  # mean generating labels per point: each point draws 1 + Poisson(avg_labels - 1)
    max_labels: int = 50  # cap on the generating labels a point draws
    zipf_alpha: float = 1.0  # label popularity: rank r drawn with probability proportional to (r + 1) ** -zipf_alpha
    # Share of the generating labels dropped from the observed ones (missing labels); no predictor beats
    # P@1 = 1 - label_noise.
    label_noise: float = 0.1
    signature_size: int = 8  # feature ids in each label's signature
    signature_keep: float = 0.8  # probability that each signature feature of a generating label is emitted, in (0, 1]
    background_features: float = 20.0  # mean number of Zipf background words added to each point (Poisson), >= 0
    feature_alpha: float = 1.0  # Zipf exponent of the background vocabulary, in [0, 5]
    seed: int = 0  # generator seed (another seed is other data of the same sizes)
    # > 1: labels come in families of this size whose members share their first family_shared signature slots,
    # so a sibling is a confusable (hard) negative; 1: every signature is the label's own.
    family_size: int = 1
    family_shared: int = 0  # family_size > 1: signature slots a family's members share
    # 1: a family's members take adjacent popularity ranks (siblings about as popular, a head label's siblings head
    # labels); 0: ranks drawn at random for every label, families included.
    family_adjacent: int = 0
    # 1: twin labels 2m, 2m+1 told apart only by which signature halves co-occur (a non-linear family a linear
    # model cannot solve); 0: off.
    xor_pairs: int = 0


@dataclass(frozen=True)
class SyntheticLFConfig:
    """Synthetic label-feature data with a known teacher (xc.data.synthetic_lf): label texts are random
    pseudo-word sequences, queries borrow words of a few seed labels, and a random bag-of-words teacher
    tower decides each query's labels (its top labels_per_query by teacher score)."""

    num_train: int = 8000  # training queries generated
    num_test: int = 1000  # test queries generated
    num_labels: int = 4000  # labels, each with a generated text
    vocab: int = 2000  # pseudo-words w0 .. w{vocab-1}, each one token of the MiniLM tokenizer
    label_words: int = 6  # words per label text
    query_words: int = 8  # words per query text (borrowed from seed labels, plus noise)
    seed_labels: int = 2  # labels a query borrows words from
    noise_words: int = 2  # random words added to a query
    labels_per_query: int = 3  # teacher's top labels become the query's positives
    teacher_dim: int = 128  # width of the random teacher embedding table that decides the labels
    seed: int = 0  # generator seed


@dataclass(frozen=True)
class RecordsConfig:
    """data.kind=jsonl|csv|tsv: which fields of a record hold what (xc/data/records.py)."""

    text_field: str = "text"  # the item's text
    labels_field: str = "labels"  # its label names: a JSON list, or (CSV/TSV) a delimited string
    label_delimiter: str = ","  # CSV/TSV: between label names within the labels field


@dataclass(frozen=True)
class DataConfig:
    """The data set: where it is, its format, the generators' parameters and the validation split."""

    # Name of the data set: the cache sub-directory (cache_dir/name) and the default run name's first part.
    name: str = "synthetic"
    # File layout: synthetic | synthetic_lf (generated) | xc_sparse | lf_raw | npz | arff | libsvm
    # (xc/data/formats.py) | jsonl | csv | tsv (xc/data/records.py).
    kind: str = "synthetic"
    path: str | None = None  # the source directory (every kind but the generated ones, which ignore it)
    cache_dir: str = ".cache/xc-data"  # generated data, converted sources and token ids are cached in cache_dir/name
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # data.kind=synthetic: the generator
    records: RecordsConfig = field(default_factory=RecordsConfig)  # data.kind=jsonl|csv|tsv: the record fields
    # data.kind=synthetic_lf: the generator
    synthetic_lf: SyntheticLFConfig = field(default_factory=SyntheticLFConfig)
    label_text_augmentation: bool = False  # LF data: label texts become extra training points
    max_len: int = 32  # tokens per text for transformer encoders and token-bag towers (longer texts are cut)
    # Validation split carved from the training points (classifier mode): round(valid_fraction * N) points,
    # at most valid_max_points, held out of training; every post-training choice (kNN fusion) is made on it.
    valid_fraction: float = 0.1
    valid_max_points: int = 5000  # cap on the validation split's points (see valid_fraction)
    # The seed of that split; None = the run's seed. Ensemble members (xc/ensemble/members.py) train with seeds of
    # their own on the same split, so their validation figures are comparable and can be averaged.
    split_seed: int | None = None
    # Which of the disjoint splits of that size and seed is held out (xc.data.inputs.split_validation); a cross-fitted
    # ensemble's member m holds out fold m.
    valid_fold: int = 0

    def valid_seed(self, run_seed: int) -> int:
        return run_seed if self.split_seed is None else self.split_seed


@dataclass(frozen=True)
class ModelConfig:
    """The query encoder, the classifier rows and, in the dual mode, the label tower."""

    # Query encoder: bow (sparse features into an embedding bag + MLP) | transformer (text; model.path) | dense
    # (precomputed dense features + MLP).
    encoder: str = "bow"
    # bow/dense: width of the feature embedding table (the token-bag tower's too); a transformer's width is its own.
    embed_dim: int = 1024
    # bow/dense: MLP widths after the bag; None = from the data: [512] under 1000 features, else none (xc/defaults/)
    hidden_dims: list[int] | None = None
    path: str | None = None  # transformer: local weights dir; None = packaged all-MiniLM-L6-v2
    pooling: str = "mean"  # transformer: mean (mask-weighted mean of the last hidden states) | cls (the first token)
    # final linear projection to d (the classifier rows' width); None = from the memory the run has: the widest of
    # the encoder's width and the powers of two below it (at least 64) whose rows, state, snapshot and miner fit in
    # 60% of it (xc/defaults/ resolve_rows; logged; a resumed run keeps its checkpoint's)
    bottleneck_dim: int | None = None
    # bow: the feature table is trained by gathered rows (a step reads and writes only its batch's rows, Adam
    # applied row by row as a dense Adam would move them; xc/train/optim.py RowTableAdam); None = from the data:
    # where a batch touches at most a quarter of the rows, or num_features * embed_dim > SPARSE_TABLE_FLOATS
    # (xc/defaults/)
    sparse_features: bool | None = None
    dropout: float = 0.5  # dropout on the encoder's output (and between bow/dense/token-bag MLP layers), in [0, 1)
    input_dropout: float = 0.0  # bow: drop input features at random while training (rescaled)
    normalize: bool = False  # L2-normalise query embeddings
    label_bias: bool = False  # a per-label bias: a constant 1 is appended to every query embedding
    # bow/dense inputs: none | idf (log(N / document frequency), from train) | auto: idf where the model has lexical
    # weights and the stored values are counts, else none (xc/defaults/ resolve_feature_weighting; logged)
    feature_weighting: str = "auto"
    classifier_init_std: float = 0.01  # standard deviation of the classifier rows' normal initialisation
    # How the classifier rows start: centroid (a label with training points at their mean embedding by the initial
    # encoder, scaled 2 ln C, C the candidates a query's loss scores; the others at random; xc/train/row_init.py)
    # | random (every row normal with classifier_init_std) | auto: centroid where the training points carry under
    # one positive a label on average (a row then sees under one positive an epoch), else random (logged)
    classifier_init: str = "auto"
    # centroid: the rows' norm over the mean embedding norm; None = 2 ln C (a cosine margin of 0.5 then gives the
    # positive half the softmax mass over the C candidates; docs/row_init.md)
    classifier_init_scale: float | None = None
    # The encoder's learning rate unless train.lr_encoder sets one: a bag-of-words encoder trained from
    # scratch wants ~1e-3, a pretrained transformer ~2e-5 (MiniLM at 1e-3 learns, then diverges).
    lr_encoder: float = 1e-3
    # Storage of the rows: auto | float32 | bfloat16 | float16. auto: float32 where the rows at their width, their
    # state, the miner's snapshot and index fit in 60% of the memory the run has, else bfloat16 without masters,
    # stochastically rounded (chosen with the width: xc/defaults/; a resumed run keeps its checkpoint's).
    classifier_dtype: str = "auto"
    # An explicit bfloat16/float16: keep an fp32 master copy that the optimiser updates (the stored rows are its
    # rounding). Without it, an update smaller than half a unit in the last place of bf16 (~0.4% of the row
    # value) is rounded away unless rounded stochastically. Costs 4 more bytes per element (bf16 + master: 6 B,
    # vs 4 B for fp32 rows). float16 rows need it.
    classifier_master_fp32: bool = True
    # How bfloat16 rows without masters store an update: auto | nearest | stochastic. auto: stochastic (unbiased,
    # keyed by seed, label, column and step, so independent of the shard layout; xc/models/rounding.py) for
    # bfloat16 rows without masters, nearest otherwise.
    classifier_rounding: str = "auto"
    # bow, classifier mode: S > 0 adds S weights per label on its own input features (the S largest of its training
    # points' summed tf-idf), trained with the rows in the same step (xc/models/lexical.py); 0 = dense rows alone;
    # None = 32 where they can train (one model on one rank, sampled candidates), over 50,000 training points carry
    # under 32 positives a label on average, else 0 (xc/defaults/ resolve_lexical; logged; a resumed run keeps its
    # checkpoint's)
    lexical_features: int | None = None
    # How the lexical weights start: zero | centroid (each label's training points' summed tf-idf on its support,
    # scaled to norm lexical_init_scale; xc/models/lexical.py centroid_weights) | explained (as centroid, from each
    # label's share of its points' features: what its co-occurring labels explain goes to them; explained_inputs;
    # non-negative inputs only) | auto: explained where the rows start at their centroids (model.classifier_init;
    # centroid where the inputs hold negative values), else zero: where labels have under one training point each, a
    # label's weights see under one positive update an epoch, and from 0 they stay what the first steps made of
    # them. At 10^6 labels explained against centroid, paired: the model under its prior -0.12 (SE 0.14) / +0.84 /
    # +1.22 P@1/3/5, served -0.14 (0.13) / +0.07 / +0.36, validation 72.77 against 71.88 after epoch 1; at 10^7 as
    # served +0.24 / +0.55 / +0.49 (docs/lexical_weights.md, "Where they start")
    lexical_init: str = "auto"
    # centroid: the weights' norm; None = twice the rows' centroid scale (2 x (model.classifier_init_scale or 2 ln C):
    # chosen on validation at 10^6 labels against 1x and a zero start)
    lexical_init_scale: float | None = None
    # Dual-encoder (label-feature) mode, docs/label_features.md: a label's score is <f(x), g(text_l)> (+ w_l).
    mode: str = "classifier"  # classifier (one free vector per label) | dual (label tower over label text)
    tower: str = "tokenbag"  # dual: tokenbag (mean EmbeddingBag over token ids + MLP, CPU-sized) | transformer
    share_towers: bool = True  # dual: one tower encodes queries and labels (False: a separate label tower g)
    free_vectors: bool = False  # dual: add a free per-label vector w_l to g(text_l) (DEXA/NGAME style)


@dataclass(frozen=True)
class DynamicTreeConfig:
    """Every parameter of the dynamic tree source (`sampler=dynamic_tree`)."""

    num_landmarks: int = 128  # d', Nystrom landmarks: the width of the low-dimensional label cache (paper: 128)
    num_trees: int = 0  # T, trees per shard; 0 = ceil(n / targets_per_tree) (paper: 100 at 8.8M-21M targets)
    targets_per_tree: int = 5000  # tree size when num_trees = 0 (recall at a fixed frontier falls with size)
    base: float = 1.05  # b, tree base, > 1 (paper)
    deepest_level: int = -15  # m, deepest level FindClustering expands to (paper: -11 MSMARCO, -14 NQ)
    frontier: int = 200  # F, frontier cap per query per tree (paper: 100)
    top_clusters: int = 64  # k clusters kept from Algorithm 2's partition (paper: unstated)
    coarse: bool = True  # add the root's singleton + children as mixture components (Q > 0 everywhere)
    beta: float = 20.0  # sampling inverse temperature on Nystrom scores (paper's score scale)
    num_chains: int = 16  # MH chains per query per tree (paper: unstated)
    chain_len: int = 2  # MH steps per chain (paper: 2)
    # w, steps between approximate re-encodes + partial rebuilds; 0 = sampler.cache_refresh_every
    refresh_every: int = 0
    regression_samples: int = 8192  # s', targets freshly encoded per approximate re-encode (paper: 8192)
    ridge: float = 1e-3  # λ, relative ridge of the Nystrom KRR
    rcond: float = 1e-6  # eigenvalues of W below rcond·λ_max are dropped in W^{-1/2}
    exact_writeback: bool = True  # write the s' exact encodings back into the cache
    renormalize: bool = True  # rescale regressed embeddings to unit norm (encoders output unit vectors)
    rebuild_level: int = -6  # r, subtrees rooted at level <= r are rebuilt after each re-encode
    full_refresh_steps: list[int] = field(default_factory=list)  # steps with an exact full refresh
    seed: int = 0  # seed of the landmarks, trees and chains (mixed with the run's seed and the shard)
    cache_path: str | None = None  # memmap the (n, d') feature cache here instead of RAM

    def validate(self, prefix: str = "sampler.tree") -> None:
        positive = ("num_landmarks", "targets_per_tree", "frontier", "top_clusters", "num_chains",
                    "regression_samples")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.refresh_every < 0:
            raise ConfigError(f"{prefix}.refresh_every", f"must be >= 0 (0 = sampler.cache_refresh_every), got {self.refresh_every}")
        if self.num_trees < 0:
            raise ConfigError(f"{prefix}.num_trees", f"must be >= 0 (0 = auto), got {self.num_trees}")
        if self.chain_len < 0:
            raise ConfigError(f"{prefix}.chain_len", f"must be >= 0, got {self.chain_len}")
        if self.base <= 1.0:
            raise ConfigError(f"{prefix}.base", f"must be > 1, got {self.base}")
        if self.beta <= 0:
            raise ConfigError(f"{prefix}.beta", f"must be > 0, got {self.beta}")
        if self.ridge < 0:
            raise ConfigError(f"{prefix}.ridge", f"must be >= 0, got {self.ridge}")


@dataclass(frozen=True)
class SamplerConfig:
    """Negative sampling (xc.sampling; docs/samplers.md says which sampler goes with which loss).

    Every sampler gets the same budget of k_hard + k_random negatives per query (split evenly
    across label shards), so `sampler=<name>` compares samplers at equal cost.
    """

    # The negative sampler: astra | uniform | hard | full | popularity | inbatch | snm | ehard | curriculum |
    # midx_pq | midx_rq | lsh_embedding | lsh_label, and for model.mode=dual the label-cache sources lf_stale |
    # lf_exhaustive | lf_partial | corrector | dynamic_tree (docs/samplers.md). Classifier mode: full where the
    # data has no more labels than k_hard + k_random (xc/defaults/).
    name: str = "astra"
    loss: str = "bce"  # bce (ASTRA eq. 2 weighted BCE) | softmax (sampled softmax, per positive)
    logq_correction: bool = True  # softmax: subtract log(c q) from sampled logits (False = uncorrected)
    k_pos: int = 8  # positives per query (subsampled with weight |P|/k_pos when a query has more)
    k_hard: int = 16  # hard negatives per query, split evenly across label shards
    k_random: int = 64  # uniform negatives per query, split evenly across label shards
    # tau_s: first epoch that uses hard negatives; null = 1, or 2 with an asynchronous miner on classifier rows
    # (xc/defaults/)
    start_epoch: int | None = None
    refresh_every: int = 1  # tau_r: epochs between hard-negative refreshes
    # Queries (and label texts) per block in the encoding passes for mining and snapshots.
    mining_batch_size: int = 4096
    hard_source: str = "classifier"  # classifier (w-hard) | label_text (E-hard: index label-text embeddings)
    curriculum_epochs: int = 5  # curriculum: epochs over which the hard share ramps from 0 to k_hard
    popularity_alpha: float = 0.75  # popularity: q proportional to (train frequency + 1) ** alpha
    # astra / curriculum: where the random part of the mixture draws from: uniform (eq. 2, as in the paper) |
    # popularity (q of the line above, weighted 1 / (k q); unbiased too; xc/sampling/proposal.py); null = popularity
    # where k_hard + k_random < 1% of the labels, else uniform (xc/defaults/)
    random_proposal: str | None = None
    snm_pool: int = 1024  # stochastic negative mining: uniform candidates per query, top ones kept
    midx_codewords: int = 32  # midx_pq/midx_rq: K codewords in each of the two codebooks
    midx_kmeans_iters: int = 25  # midx: K-means iterations per rebuild (warm-started from the last epoch)
    midx_learn_steps: int = 0  # midx: > 0 refines codewords by gradient (reconstruction + Renyi-2) per rebuild
    midx_learn_lr: float = 0.01  # midx: learning rate of those codeword refinement steps
    lsh_family: str = "simhash"  # lsh_embedding/lsh_label: hash family, simhash | dwta
    lsh_bits: int = 8  # lsh: K hash functions concatenated per table
    lsh_tables: int = 16  # lsh: L tables
    lsh_window: int = 0  # lsh: ids read per bucket probe (0 = 2 * ceil(budget / tables)); bounds query cost
    lsh_dwta_bin: int = 8  # DWTA: coordinates per winner-take-all bin
    lsh_rebuild_every: int = 50  # lsh: steps between re-hashing the rows (0 = at epoch boundaries only)
    lsh_drift_threshold: float = 0.0  # lsh: > 0 also re-hashes when sampled rows moved this much (relative L2)
    # Label-embedding cache sources (model.mode=dual; xc/sampling/label_cache.py, corrector.py):
    # w, optimizer steps between refreshes (lf_exhaustive, lf_partial).
    cache_refresh_every: int = 100
    cache_partial_fraction: float = 0.25  # lf_partial: share of the shard's rows (the oldest) re-encoded per refresh
    cache_mine_chunk: int = 8192  # label caches: cache rows per block of the exact top-k matmul
    corrector_hidden: int = 256  # corrector: hidden width of the residual MLP (paper: 8192; CPU-sized here)
    corrector_lambda: float = 10.0  # corrector: weight of L_h in L_task + lambda * L_h
    corrector_lr: float = 1e-3  # corrector: Adam learning rate of h
    corrector_mine_every: int = 1  # corrector: h(B) recomputed for mining every this many h updates (1 = every step)
    # corrector: h trains on the step's positives and mined hard ids plus at most this many of its other labels
    # (a seeded sample); 0 = on every label the step scored
    corrector_max_others: int = 0
    tree: DynamicTreeConfig = field(default_factory=DynamicTreeConfig)  # dynamic_tree (docs/dynamic_tree.md)
    # corrector: the loss L_h that trains h: softmax (cross-entropy between the truncated softmaxes under h(B) and under
    # the fresh encodings) | mse
    corrector_loss: str = "softmax"
    # classifier mode, astra/uniform/curriculum: 0 = each query draws its own k_hard + k_random negatives; N > 0 = the
    # label shards draw ONE pool per batch, scored for every query: the union of the batch's hard negatives plus
    # N (+ B x the unused hard slots) uniform draws, eq.-2 weights, unbiased (xc/sampling/samplers.py shared_pool);
    # null = the rule in xc/defaults/ (1024 where k_hard + k_random < 1% of the labels, else 0)
    shared_pool: int | None = None
    # dual mode: one set of k_random uniform negatives per shard shared by the whole batch (NGAME/DEXA), so a
    # step encodes k_random labels instead of B * k_random; false = each query draws its own
    shared_uniform: bool = False
    # dual mode: the batch's positives (encoded anyway) join every query's candidates as negatives, a
    # deterministic set like the hard one, so the loss stays unbiased (xc/train/modes/dual/step.py); no extra
    # encoding
    inbatch_negatives: bool = False


# The ANN settings (`miner.ann`) are the ANN package's own schema, one definition for the miner, serving and
# benchmarks (fields, defaults, checks and each field's documentation in xc/ann/base.py).
AnnConfig = AnnParams


@dataclass(frozen=True)
class MinerConfig:
    """Who mines hard negatives, where, and what the trainer does when they are late."""

    # sync: the trainer mines at the epoch boundary | pool: CPU worker processes beside rank 0 mine asynchronously |
    # external: an `xc-miner` process (maybe elsewhere) does | ray: Ray tasks on a Ray cluster, driven by rank 0
    # (xc/miner/ray_pool.py) | auto (xc-train's default, conf/miner/auto.yaml): pool where the ranks train on GPUs
    # and cores are spare, else sync (xc/defaults/). A Trainer built directly from this dataclass keeps sync.
    mode: str = "sync"
    workers: int = 2  # pool: worker processes (one task per label shard); ray, local instance: its CPUs / threads
    threads_per_worker: int = 1  # pool/ray: threads each worker's index build and search use
    query_source: str = "encode"  # encode: a dedicated encoding pass; train_pass: embeddings saved while training
    # asynchronous miners, at an epoch boundary whose generation has not arrived: bounded (train on the newest
    # generation that has, and wait only where the negatives in use would trail the schedule by more than
    # max_lag refreshes) | wait (wait for each generation on schedule: the run's figures do not depend on the
    # miner's speed) | reuse (never wait). Every wait ends after wait_timeout_s (the generation in use is kept)
    late_policy: str = "bounded"
    max_lag: int = 1  # late_policy=bounded: refreshes the negatives in use may trail the schedule without a wait
    # asynchronous miners: the share of the training queries each generation mines, a window rotating over the rows
    # (the others keep their negatives until their turn); None = the rule (xc/refresh/slices.py): every query until
    # the miner is measured, then what its rate searches in 0.8 of an epoch, at least 1 / max_rotation of them
    refresh_share: float | None = None
    max_rotation: int = 4  # the rule's bound: every query's negatives are refreshed within this many generations
    wait_timeout_s: float = 600.0  # seconds rank 0 waits for a late generation before training on with the one in use
    keep_generations: int = 3  # snapshot and negative generations kept on disk; older ones are deleted
    recall_sample: int = 512  # queries per shard whose ANN result is checked against exact search (0 = no check)
    staleness_sample: int = 256  # queries whose stored negatives are compared with the current top-k (0 = off)
    max_retries: int = 2  # per shard task, after a worker crash
    max_restarts: int = 2  # pool: restarts of a dead miner thread before the run stops with an error
    poll_seconds: float = 0.5  # seconds between looks for a new snapshot or generation while waiting for one
    # pool/external: write snapshot files on a background thread while training goes on, from a copy of the rows taken
    # at the boundary. None = the rule (xc/defaults/): yes where the rows, their state and that copy fit in 60% of
    # the free memory (the classifier_dtype rule's share) and, on CPU ranks, the copy alone is at most 12.5% of it
    # (at 10^7 labels of 256 in bfloat16 the copy, 4.8 GiB, raised the peak by as much to save 5.4 s of a 30 s stall
    # a generation); else the trainer writes them from the rows and waits
    async_snapshot: bool | None = None
    # async: publish the snapshot this many optimizer steps after the epoch boundary (same on every rank)
    snapshot_finish_steps: int = 10
    # asynchronous miners: the first generation's snapshot is taken this share of the way into the epoch that
    # mines it (0 = at its start). > 0 lets hard negatives start at epoch 1 from trained rows. None = the rule
    # (xc/defaults/): 0.5 for an asynchronous miner on classifier rows with re-ranking, start_epoch to its rule
    first_snapshot_at: float | None = None
    # asynchronous miners: candidates per query the miner returns (split over label shards like k_hard); at the
    # switch the trainer keeps the k_hard of them that score highest under its current rows and query
    # embeddings (xc/refresh/rerank.py). None = from the mode (xc/defaults/); k_hard or 0 = keep the mined top-k_hard
    rerank_candidates: int | None = None
    # ray: the cluster to join: "" = start a local instance; "auto" = the one `ray start` runs on this host, or
    # RAY_ADDRESS; "HOST:PORT"
    ray_address: str = ""
    ray_query_blocks: int = 1  # ray: search tasks per shard (query blocks spread over nodes)
    ray_object_store_mb: int = 512  # ray, local instance: its object store in MB (at least 80, Ray's minimum)
    ann: AnnConfig = field(default_factory=AnnConfig)  # the ANN index the miner builds and searches per label shard


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation: steps, batch, learning rates, checkpoints, device and precision."""

    epochs: int | None = None  # None = from the data size: ~1000 steps, 3 to 30 epochs (xc/defaults/)
    # train.epochs is a cap, and validation decides when to stop: the rate stays up while an epoch gains more than
    # its standard error over the best epoch before it on the validation split, then one last epoch decays it
    # (xc/train/schedule.py); None = on
    # where the data's step rule gives 3 epochs (about 85,000 training points and more) with epochs left to it, the
    # cap then 12 (xc/defaults/)
    epochs_by_validation: bool | None = None
    # > 0: under epochs_by_validation, the last epoch is the one after which two more epochs at the pace so far
    # would pass this many seconds of the epoch loop (training, refreshes, each epoch's evaluation); 0 = none
    time_budget: float = 0.0
    # under epochs_by_validation: how many epochs in a row must not beat the best before them by more than one
    # standard error before the last, decaying epoch is called (at 10^7 labels 2 trained one more flat epoch and
    # ended no better: docs/scale_1e7.md, "The schedule")
    plateau_epochs: int = 1
    # global batch (all ranks together) per optimizer step; None = from the data size: 256, halved down to 16
    # while an epoch has under 16 steps (xc/defaults/)
    batch_size: int | None = None
    grad_accum: int = 1  # micro-batches per optimizer step (batch_size must be a multiple of it)
    lr_encoder: float | None = None  # None = model.lr_encoder (the encoder's own default); resolved by build_config
    lr_classifier: float | None = None  # None = the row optimiser's own (rowadagrad 0.1, sgd 32; xc/defaults/)
    lr_lexical: float | None = None  # the lexical weights' row-wise Adagrad rate (model.lexical_features); None = 1.0
    optimizer_classifier: str = "rowadagrad"  # rowadagrad (row-wise Adagrad on touched rows) | sgd (xc/train/optim.py)
    weight_decay_encoder: float = 0.0  # decoupled (AdamW) or L2 (Adam) weight decay of the encoder's parameters
    weight_decay_classifier: float = 0.0  # weight decay of the classifier rows a step touches
    optimizer_encoder: str = "adamw"  # adam | adamw
    warmup_steps: int | None = None  # None = 5% of the run's steps, at most 100 (xc/defaults/)
    min_lr_ratio: float = 0.0  # cosine decays to base_lr * min_lr_ratio, in [0, 1]
    max_steps: int = -1  # stop after this many optimizer steps (benchmarks, tests); -1 = all epochs
    checkpoint_every_steps: int = 0  # > 0: also checkpoint every this many steps; 0 = at epoch ends only
    checkpoint_every_minutes: float = 0.0  # > 0: also checkpoint when this much time passed since the last one
    keep_checkpoints: int = 2  # newest checkpoints kept (plus the best epoch's); 0 = keep all
    # a finished run keeps the checkpoint it serves and its newest (a rerun evaluates again, a raised train.epochs
    # trains on) and drops its own miner's snapshots and negatives (10^7 labels: 11 GB kept of 43); false keeps all
    prune_when_done: bool = True
    # auto: continue from the newest checkpoint in run_dir if there is one | never: move the previous run to
    # run_dir/archive and start afresh | must: fail unless there is a checkpoint to resume
    resume: str = "auto"
    device: str = "auto"  # auto (this rank's GPU if CUDA is there, else the CPU) | cpu | cuda
    log_every: int = 50  # optimizer steps between logged training metrics
    nonfinite: str = "stop"  # stop | skip: what a NaN/inf loss or gradient does (docs/reliability.md)
    amp: str = "none"  # none | bf16 | fp16: autocast for the encoder forward (fp16 only on CUDA, with loss scaling)
    # prepare the next micro-batch on a background thread; null = on with CUDA on the host path
    prefetch: bool | None = None
    # labels, inputs and draws on the training device (xc/train/modes/classifier/device_batches.py); null = on with
    # CUDA where the sampler draws there (uniform, hard, astra, curriculum, the exact loss)
    device_batches: bool | None = None
    # batch assembly with fixed shapes (padded, masked, no host reads: capturable as a CUDA graph;
    # xc/sampling/fixed_shapes.py): auto | on | off; auto = on with CUDA for uniform/hard/astra/curriculum, off on CPU
    # (xc/defaults/); on is still off where the sampler has no fixed-shape path
    static_shapes: str = "auto"
    profile_phases: bool = False  # time each phase of a step (ASTRA Table 3); logged as phase_seconds
    compile: bool = False  # torch.compile the training forward of the encoder (its first steps compile)
    # Models trained with different seeds whose label probabilities are averaged, then kNN-fused once
    # (xc/ensemble/members.py); None = from the data: 3 when at most 50,000 points train (classifier mode), else 1.
    ensemble: int | None = None
    # crossfit: member m holds out validation fold m (disjoint folds), so the members together train on every
    # point and the fusion is chosen on every fold, each point scored by the member that never saw it;
    # shared: every member holds out the same split.
    ensemble_split: str = "crossfit"


@dataclass(frozen=True)
class KnnFusionConfig:
    """Instance memory at inference (xc/fitting/fusion.py): fused = (1 - lambda) p_model + lambda vote_k, with lambda, k
    and the space chosen on the validation split (data.valid_fraction); lambda = 0 is the plain model."""

    enabled: bool = True  # choose and apply the kNN fusion after training; serving uses it (false: the plain model)
    # input: the data's tf-idf features; embedding: the trained encoder's; both: the two votes averaged
    spaces: list[str] = field(default_factory=lambda: ["input", "embedding", "both"])
    ks: list[int] = field(default_factory=lambda: [5, 10, 20, 50])  # neighbours tried
    lambdas: list[float] = field(default_factory=lambda: [round(0.1 * i, 1) for i in range(11)])  # mixing weights tried
    # the model's probabilities at scores / T before mixing (xc/fitting/fusion.py: why); T = 1 is the plain softmax
    temperatures: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    candidates: int = 20  # labels per query from each side (model top, vote top)
    # above this many training points the final evaluation skips fusion; 0 = no cap (the default: at 2M training
    # points and 10^6 labels the fusion's exact searches took 19 minutes on 2 cores, less than a training epoch, and
    # lifted P@1 from 46 to 88 on a family only a kNN solves; docs/accuracy_synthetic.md)
    max_train_points: int = 0
    lam: float | None = None  # a fixed lambda (with k and space): no validation choice
    k: int | None = None  # with lam: the fixed number of neighbours
    space: str | None = None  # with lam: the fixed space (input | embedding | both)
    temperature: float | None = None  # with lam: a fixed temperature (default 1)


@dataclass(frozen=True)
class RankerConfig:
    """A sparse linear ranker over the input tf-idf fused beside the model and the kNN vote (xc/fitting/ranker.py):
    fused = [(1 - lambda) p_model + lambda vote_k] * sigmoid(u_l . x + b_l) ** gamma, gamma chosen with lambda on the
    validation split; gamma = 0 is the fusion without it. Trained where the data has sparse input features."""

    enabled: bool = True  # train the ranker where the data has sparse input features (false: never)
    gammas: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0])  # exponents tried
    reg: float = 0.2  # L2 weight on each label's sparse weights (chosen on debian-deps validation: 0.1-1)
    iterations: int = 40  # L-BFGS iterations per block of labels
    neighbours: int = 20  # other training points whose labels are a point's negatives
    negatives: int = 100  # their best-voted labels paired with each point
    # Also up to this many of the model's own hard negatives for the point (the last mined table, split evenly over
    # the label shards): the ranker re-ranks the model's candidates, so it learns to separate those too (0 = none)
    hard_negatives: int = 16
    # labels per independent solve (block b on rank b % world size; the unit the threads share)
    block_labels: int = 2048
    # at most this many (pair, feature) entries, estimated N x (negatives + positives per point) x non-zeros per row:
    # above it each point pairs with fewer of its neighbours' labels, as many as fit; where its positives alone exceed
    # it, with its positives and the model's hard negatives only, each row cut to its largest values as many as fit
    # (10^7 labels: 9 of 49); ~16 bytes and a few multiply-adds each per L-BFGS iteration. The estimate
    # counts neither repeats (about half of 100 neighbour labels) nor the model's hard negatives: debian-deps 4.9e7
    # (3.1e7 built), the main job 1.0e8, synthetic 10^5 labels 1e9, narrowed to 15 negatives a point (2.9e8 built,
    # 7.5 minutes and 8.1 GB peak on 2 cores); 0 = no cap
    max_pair_features: int = 200_000_000
    # the neighbour search's budget of multiply-adds: beyond it the most frequent features are left out of the
    # search (xc/fitting/ranker.py `search_features`; debian-deps needs 7e8, Bibtex 3e8, synthetic 10^5 labels
    # 1.1e11; 0: exact)
    search_products: int = 4_000_000_000
    gamma: float | None = None  # a fixed exponent: lambda is chosen at it, kept even where 0 would do better


@dataclass(frozen=True)
class LabelPriorConfig:
    """A label prior at inference (xc/fitting/label_prior.py): score + beta * log(1 + n_l), beta chosen on the
    validation split (data.valid_fraction) by mean P@k; beta = 0 is the plain model."""

    enabled: bool = True  # choose and apply the prior (false: the plain model)
    # betas tried; ties keep the smaller |beta|
    betas: list[float] = field(default_factory=lambda: [-2.0, -1.5, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5])
    beta: float | None = None  # a fixed beta: no validation choice


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation: metrics, epoch selection, calibration and the inference-time fusions."""

    every_epochs: int = 0  # rank the test split every N epochs (0: once, at the end; validation ranks every epoch)
    topk: int = 5  # labels ranked per test point (at least the largest of ks)
    ks: list[int] = field(default_factory=lambda: [1, 3, 5])  # the k of the reported P@k, nDCG@k and PSP@k
    batch_size: int = 1024  # queries per batch when encoding and ranking for evaluation and serving
    propensity_a: float = 0.55  # A of the Jain et al. (2016) label propensities behind the PSP@k metrics
    propensity_b: float = 1.5  # B of those propensities
    max_points: int = 0  # evaluate on the first N test points only (0 = all)
    # keep the best epoch on validation, if it beats the last by > 1 SE (xc/eval/epoch_select.py)
    select_epoch: bool = True
    select_epoch_patience: int = 8  # stop once validation has not improved for this many epochs (0: train them all)
    # fit RUN_DIR/calibration.json (served score -> probability, on validation) and report precision/recall at
    # thresholds on test; xc-predict --min-score needs it (xc/serve/calibration.py)
    calibrate: bool = True
    knn_fusion: KnnFusionConfig = field(default_factory=KnnFusionConfig)  # the kNN vote fused with the model
    ranker: RankerConfig = field(default_factory=RankerConfig)  # the sparse linear ranker fused beside it
    label_prior: LabelPriorConfig = field(default_factory=LabelPriorConfig)  # the label-frequency prior


@dataclass(frozen=True)
class ParallelConfig:
    """Distributed training: the process group and how the label rows are sharded."""

    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | gloo | nccl
    num_label_shards: int = 0  # 0 = world size; must be a multiple of the world size
    shard_multiple: int = 16  # each shard's row count is padded to a multiple of this
    timeout_s: float = 1800.0  # a collective that waits longer than this for a rank fails the job
    heartbeat_s: float = 60.0  # rank 0 names ranks whose step lags behind for this long (0 = off)


@dataclass(frozen=True)
class LoggerConfig:
    """Where metrics go: RUN_DIR/log.jsonl, Weights & Biases, progress bars."""

    wandb: str = "offline"  # offline | online (needs WANDB_API_KEY) | disabled
    project: str = "xc"  # the Weights & Biases project
    entity: str | None = None  # the Weights & Biases team or user; null = the account's default
    # append every logged event to RUN_DIR/log.jsonl, each with the process's resident memory in GiB (`rss_gib` now,
    # `peak_rss_gib` so far)
    jsonl: bool = True
    progress: bool = True  # progress bars on rank 0


@dataclass(frozen=True)
class XCConfig:
    """The whole run: its name, directory and seed, and one section per hydra group."""

    name: str = "synthetic-astra"  # the run's name in logs and W&B (conf/config.yaml: DATA-SAMPLER)
    run_dir: str = "runs/synthetic-astra"  # where checkpoints, logs, metrics and the exported model go
    seed: int = 0  # the run's seed: weights, sampling and (unless data.split_seed) the validation split
    data: DataConfig = field(default_factory=DataConfig)  # the data set
    model: ModelConfig = field(default_factory=ModelConfig)  # encoder and classifier
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # negative sampling
    miner: MinerConfig = field(default_factory=MinerConfig)  # hard-negative mining
    train: TrainConfig = field(default_factory=TrainConfig)  # optimisation
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluation and inference-time fusion
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # distributed training
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # logging


def build_config(raw: dict[str, Any], ignore: tuple[str, ...] = ("hydra", "defaults")) -> XCConfig:
    """Convert a plain (resolved) dict into `XCConfig`, checking keys, types and choices."""
    raw = {k: v for k, v in raw.items() if k not in ignore}
    cfg = convert(XCConfig, raw, "")
    if cfg.train.lr_encoder is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr_encoder=cfg.model.lr_encoder))
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The inverse of `build_config`: a JSON-friendly dict (for logs, manifests, checkpoints)."""
    return dataclasses.asdict(cfg)
