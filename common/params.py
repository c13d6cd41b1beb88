"""params.yaml as one typed schema: every section, key, type and range of the pipeline.

`validate(raw, source)` checks a whole parsed params file (profiles too) before any stage
does work; an error is one line naming the file, the dotted key and what was expected:
`params.yaml: train.mlp.max_epochs: expected an integer >= 1, got 'three'`.  Unknown keys are
errors.  Stages and library code read their typed section (`params.train`, ...), never raw
dictionaries.  This module imports nothing of specstop but the error type.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import platformdirs
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      model_validator)
from pydantic_core import PydanticCustomError

from . import paths
from .errors import SpecstopError
from .schema_errors import CROSS_KEY, dotted, problem

METHODS = ("ar", "sd", "mcsd", "ti-mcsd", "tree", "lookup")
STOP_FAMILIES = ("logistic", "lightgbm", "mlp")
BENCH_METHODS = (  # the bench's method names; <base>+<family> needs that family trained
    "ar", "ar-aa", "sd", "sd-compact", "mcsd", "ti-mcsd", "ti-mcsd+confidence",
    *[f"ti-mcsd+{family}" for family in STOP_FAMILIES], "ti-mcsd+stop_model", "static-tree",
    "tree+confidence", *[f"tree+{family}" for family in STOP_FAMILIES], "tree+stop_model",
    "tree+confidence+lookup", "tree+stop_model+lookup", "ti-mcsd-lossy", "hf-assisted",
    "hf-assisted-static", "lookup", "hf-prompt-lookup")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
PROFILES = "profiles"
MIN_TEMPERATURE = 1e-3  # below it logits / T overflow float32

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(ge=0, le=1)]
UnitFraction = Annotated[float, Field(gt=0, le=1)]


def _temperature(value: float) -> float:
    if value != 0 and not MIN_TEMPERATURE <= value <= 100:
        raise ValueError("out of range")
    return value


Temperature = Annotated[float, AfterValidator(_temperature),
                        Field(description=f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, 100]")]
Method = Literal["ar", "sd", "mcsd", "ti-mcsd", "tree", "lookup"]
BenchMethod = Literal[BENCH_METHODS]
Dtype = Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
Device = Annotated[str, Field(pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
                              description="auto, cpu, cuda or cuda:N")]


class Section(BaseModel):
    """A params section: unknown keys are errors, values are checked and then frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelsConfig(Section):
    target: str = "embedded"  # embedded | hub id | model folder | path/to/model.gguf
    draft: str = paths.DEFAULT_DRAFT  # a draft folder, any LM with the same tokenizer, or layers:N
    dtype: Dtype = "auto"  # auto = bf16 where the hardware has it natively, else float32
    device: Device = "auto"
    cpu_kernel: Literal["onednn", "aten"] = "onednn"  # linear layers on a CPU: oneDNN with
    # prepacked weights (a pass over a few tokens costs about one step) or aten's
    compile: Literal["auto", "on", "off"] = "auto"  # capture the decoding forwards with
    # torch.compile (on CUDA as CUDA graphs): auto = on CUDA only
    cache_dir: Path | None = None  # where `embedded` is converted; None: the per-user cache

    @property
    def target_cache(self) -> Path:
        """The converted embedded target's folder: `cache_dir`, else the platform's per-user
        cache (outside a project nothing is written into the current folder)."""
        return self.cache_dir or Path(platformdirs.user_cache_dir("specstop")) / "models" / "target"


class CostsConfig(Section):
    path: Path = paths.VERIFY_COSTS
    widths: list[PosInt] = [2, 4, 8, 16]
    context: PosInt = 200
    repeats: PosInt = 15


class SizesConfig(Section):
    """The size-bound counts scaled to the machine (`pipeline/sizes.py`): by
    full_until_step_ms / the target's measured step where that is slower, never below
    min_scale; None: the counts as written on every machine."""

    full_until_step_ms: PosFloat | None = None
    min_scale: UnitFraction = 0.25


class TreeConfig(Section):
    """How a round drafts and verifies: the options `decode` and `collect` share."""

    method: Method = "ti-mcsd"
    max_new_tokens: PosInt = 128
    temperature: Temperature = 0.0
    top_p: UnitFraction = 1.0
    max_depth: PosInt = 8
    mcsd_branching: list[PosInt] = [2, 2]
    ti_width: PosInt = 3
    lossy: bool = False
    without_replacement: bool = True
    seed: Seed = 0


class DecodeParams(TreeConfig):
    policy: Literal["fixed", "confidence"] = "fixed"
    gamma: PosInt = 4
    threshold: Probability = 0.4
    stop_model: Path | None = None
    lookup_branch: bool | Literal["auto"] = "auto"  # `tree`: the prompt-lookup chain as one
    # more branch; auto: where the stop model's file says it decoded faster (`models.settle`)

    @model_validator(mode="after")
    def _gamma_within_depth(self) -> "DecodeParams":
        """A gamma that is given (the default is capped at max_depth) must fit the tree."""
        used = self.policy == "fixed" and self.stop_model is None
        if used and "gamma" in self.model_fields_set and self.gamma > self.max_depth:
            raise PydanticCustomError(CROSS_KEY, f"gamma: {self.gamma} levels do not fit in "
                                      f"max_depth {self.max_depth} (raise max_depth or lower "
                                      f"gamma)")
        return self


class PromptsConfig(Section):
    out: Path = paths.PROMPTS
    seed: Seed = 0
    fractions: dict[str, NonNegFloat] = {"draft": 0.5, "train": 0.2, "val": 0.15, "test": 0.15}
    sources: list[dict[str, Any]] = Field(
        [{"embedded": "humaneval"}, {"embedded": "magpie", "max_prompts": 200}], min_length=1)


class TextCorpusConfig(Section):
    """Teacher-forced text beside the target's responses (drafts/text_corpus.py)."""

    tokens: NonNegInt = 0  # teacher-labelled tokens in all; 0 = off
    sources: dict[str, UnitFraction] = {"code": 0.5, "docs": 0.5}  # share per source: code
    # (the Python standard library's .py files), docs (installed packages' .md/.rst), or a
    # path (a file, or a folder's .py/.md/.rst/.txt files)
    window: Annotated[int, Field(ge=2)] = 256  # tokens per forward row
    batch_size: PosInt = 8  # windows per forward

    @model_validator(mode="after")
    def _shares_sum_to_one(self) -> "TextCorpusConfig":
        if abs(sum(self.sources.values()) - 1) > 1e-6:
            raise PydanticCustomError(CROSS_KEY, "sources: the shares must sum to 1, got "
                                      f"{sum(self.sources.values()):g}")
        return self


class CorpusConfig(Section):
    temperatures: list[Temperature] = Field([0.0, 0.7, 1.0], min_length=1)  # one response per
    # entry (0 = greedy); val responses are greedy
    max_new_tokens: PosInt = 128
    batch_size: PosInt = 16
    top_k: PosInt = 16  # teacher probabilities kept per position
    text: TextCorpusConfig = TextCorpusConfig()  # teacher-forced text (train only)


class DraftSpec(Section):
    family: Literal["compact", "feature"]
    layers: PosInt
    vocab: NonNegInt = 0  # output vocabulary size; 0 = the full vocabulary
    fuse: bool = False  # feature head: reads the target's low, middle and high layers (EAGLE-3)
    max_minutes: PosFloat | None = None  # overrides draft.train.max_minutes

    @model_validator(mode="after")
    def _fuse_needs_features(self) -> "DraftSpec":
        if self.fuse and self.family != "feature":
            raise PydanticCustomError(CROSS_KEY, "fuse: only a feature head reads the target's "
                                      "layers (family: feature)")
        return self

    @property
    def name(self) -> str:
        fused = "-fused" if self.fuse else ""
        return f"{self.family}-l{self.layers}-v{self.vocab or 'full'}{fused}"


class DraftTrainConfig(Section):
    max_minutes: PosFloat = 4.0
    max_epochs: PosInt = 20
    batch_size: PosInt = 8
    group_by_length: bool = True  # batches of sequences of similar length (less padding)
    lr: PosFloat = 1e-3
    weight_decay: NonNegFloat = 0.0
    warmup_steps: NonNegInt = 30
    schedule: Literal["constant", "cosine"] = "cosine"  # after warmup
    final_lr: Annotated[float, Field(ge=0, le=1)] = 0.1  # cosine: lr's share at the end
    feature_loss_weight: NonNegFloat = 1.0  # feature-conditioned head only
    frozen_lm_head: bool = False  # feature head: its output rows stay the target's (EAGLE's)
    feature_noise: NonNegFloat = 0.05  # uniform noise on input features
    unroll: PosInt = 1  # feature head: passes fed with its own predicted features
    val_every_steps: PosInt = 40  # also the checkpoint interval
    patience: PosInt = 4
    precision: Literal["auto", "bf16-mixed", "32-true"] = "auto"  # auto: bf16 where native
    seed: Seed = 0


class DraftEvalConfig(Section):
    prompts: PosInt = 6
    max_new_tokens: PosInt = 96
    gammas: list[PosInt] = Field([1, 2, 3, 4], min_length=1)


class DraftConfig(Section):
    out: Path = paths.DRAFT
    metrics: Path = paths.METRICS / "draft.json"
    plots: Path = paths.METRICS / "draft_plots"
    prompts: Path = paths.PROMPTS
    verify_costs: Path = paths.VERIFY_COSTS
    max_prompts: PosInt | None = None
    domains: dict[str, UnitFraction] | None = None  # share of the train prompts per source
    # (fractions summing to 1); None: the split's order, which interleaves the sources
    seed: Seed = 0
    corpus: CorpusConfig = CorpusConfig()
    sweep: list[DraftSpec] = Field(
        [DraftSpec(family="feature", layers=1, vocab=4096)], min_length=1)
    train: DraftTrainConfig = DraftTrainConfig()
    eval: DraftEvalConfig = DraftEvalConfig()

    @model_validator(mode="after")
    def _domains_sum_to_one(self) -> "DraftConfig":
        if self.domains is not None and abs(sum(self.domains.values()) - 1) > 1e-6:
            raise PydanticCustomError(CROSS_KEY, "domains: the fractions must sum to 1, got "
                                      f"{sum(self.domains.values()):g}")
        return self


class MLflowConfig(Section):
    tracking_uri: str = DEFAULT_TRACKING_URI  # env MLFLOW_TRACKING_URI overrides
    experiment: str = Field("specstop", min_length=1)

    def store(self, stage: str) -> "TrackingStore":
        """The store and experiment `<experiment>-<stage>` one stage logs to."""
        return TrackingStore(self.tracking_uri, f"{self.experiment}-{stage}")


@dataclass(frozen=True)
class TrackingStore:
    """Where one stage logs its MLflow runs."""

    uri: str  # env MLFLOW_TRACKING_URI overrides it (common.tracking.tracking_uri)
    experiment: str


class CollectConfig(TreeConfig):
    prompts: Path = paths.PROMPTS
    out: Path = paths.COLLECT
    summary: Path = paths.METRICS / "collect.json"
    splits: list[Literal["train", "val", "test"]] = Field(["train", "val"], min_length=1)
    max_prompts: PosInt | None = None
    part_size: PosInt = 4  # prompts per Parquet part (the unit of resume and sharding)
    temperatures: list[Temperature] = Field([0.0], min_length=1)  # every prompt at each
    lookup_tokens: PosInt = 10  # the longest lookup chain logged per round (the bench's
    # `prompt_lookup_tokens`: its `tree+stop_model+lookup` chains): greedy, read off the text;
    # sampled, verified beside the superset
    processes: PosInt | Literal["auto"] = "auto"  # `specstop collect --launch`'s torchrun
    # workers; auto: one per GPU, else per usable core as memory allows (collection.processes)
    overhead_prompts: NonNegInt = 2  # val prompts decoded by `ar`, `tree` and a static tree to
    # time a drafted round's host work by kind (`decoder.overhead`); 0: none, nothing charged

    @model_validator(mode="after")
    def _temperatures_only(self) -> "CollectConfig":
        """collect decodes every prompt at each of `temperatures`; a lone `temperature` would be
        ignored, so it is refused."""
        if "temperature" in self.model_fields_set:
            raise PydanticCustomError(CROSS_KEY, "temperature: collect takes temperatures, a "
                                      "list (e.g. [0.0, 0.7]: greedy and sampled rounds)")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise PydanticCustomError(CROSS_KEY, f"temperatures: {self.temperatures} repeats "
                                      f"a value")
        return self


class LogisticParams(Section):
    C: PosFloat = 1.0
    max_iter: PosInt = 1000


class LightGBMParams(Section):  # LightGBM's own defaults where params.yaml is silent
    num_leaves: Annotated[int, Field(ge=2)] = 31
    learning_rate: PosFloat = 0.1
    n_estimators: PosInt = 500
    early_stopping_rounds: PosInt = 30
    min_child_samples: PosInt = 20
    feature_fraction: UnitFraction = 1.0
    bagging_fraction: UnitFraction = 1.0
    bagging_freq: NonNegInt = 0
    lambda_l2: NonNegFloat = 0.0


class MLPParams(Section):
    hidden: list[PosInt] = Field([64, 64], min_length=1)
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1
    lr: PosFloat = 1e-3
    weight_decay: NonNegFloat = 1e-4
    batch_size: PosInt = 1024
    max_epochs: PosInt = 30
    patience: PosInt = 4


class CostRegimes(Section):
    """Cost curves of other machines' shape the winner's tree is re-tuned for (a grid; an
    empty list: none): a draft step's seconds times `draft_cost`, a target pass's seconds
    above a one-token step's times `verify_slope`."""

    draft_cost: list[PosFloat] = []
    verify_slope: list[PosFloat] = []


class StopTrainConfig(Section):
    data: Path = paths.COLLECT
    out: Path = paths.TRAIN
    metrics: Path = paths.METRICS / "train.json"
    plots: Path = paths.METRICS / "train_plots"
    families: list[Literal["logistic", "lightgbm", "mlp"]] = Field(list(STOP_FAMILIES),
                                                                   min_length=1)
    label: Literal["hard", "soft"] = "hard"
    class_weight: Literal["balanced", "none"] = "balanced"
    early_stop_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.15
    seed: Seed = 0
    search_trials: NonNegInt = 0
    rho_iterations: PosInt = 5
    threshold_grid: Annotated[int, Field(ge=2)] = 200
    charge_decision_latency: bool = True
    sampling_temperature: PosFloat | None = None  # the sampled rounds (one of
    # collect.temperatures) the sampling tree rule is tuned on; None: no sampling rule
    replay_temperatures: list[PosFloat] = []  # other sampled temperatures (of
    # collect.temperatures) the tree policies are tuned and replayed at, for the report only
    # (metrics `replay.sampling_at`); the exported sampling rule is `sampling_temperature`'s
    regimes: CostRegimes = CostRegimes()  # the greedy tree replay under other cost curves
    reach: list[NonNegFloat] = []  # strengths s: the winner's greedy tree with its p's
    # log-odds moved s toward each val row's outcome (metrics `replay.reach`); []: none
    logistic: LogisticParams = LogisticParams()
    lightgbm: LightGBMParams = LightGBMParams()
    mlp: MLPParams = MLPParams()

    def hyperparameters(self, family: str) -> dict[str, Any]:
        return getattr(self, family).model_dump()


class SettleConfig(Section):
    """The exported tree decoded in turn on val prompts beside the static shape, where the
    replay ranks the two within `margin` of each other (0: the replay decides alone), and beside
    itself with the lookup branch (`lookup`); the measured fastest is exported
    (`models.settle`)."""

    margin: NonNegFloat = 0.05
    lookup: bool = True
    prompts: PosInt = 48  # val prompts of collect.prompts, the sources interleaved
    max_new_tokens: PosInt = 64
    seed: Seed = 0

    @property
    def decodes(self) -> bool:
        """Whether the settle may decode at all (else the replay decides alone)."""
        return self.margin > 0 or self.lookup


class ExportConfig(Section):
    train: Path = paths.TRAIN
    data: Path = paths.COLLECT
    out: Path = paths.EXPORT
    metrics: Path = paths.METRICS / "export.json"
    tolerance: NonNegFloat = 1e-5
    tree_implementation: Literal["tree_trav", "perf_tree_trav", "gemm"] = "tree_trav"
    registered_model: str = Field("specstop-stop-model", min_length=1)
    costs: Path | None = None  # another machine's costs.json: re-tune the tree rules for it
    settle: SettleConfig = SettleConfig()  # this machine's only: not with `costs`


class BenchConfig(Section):
    prompts: PosInt = 24  # test prompts, taken from each source in turn (file order within)
    prompt_dir: Path = paths.PROMPTS
    max_new_tokens: PosInt = 128
    temperature: Temperature = 0.7  # the sampling run (greedy always runs)
    top_p: UnitFraction = 1.0
    seed: Seed = 0
    methods: list[BenchMethod] | None = None  # the methods the greedy run times (ar always);
    # None: all
    sampling_methods: list[BenchMethod] = Field(  # the methods the sampling run times; [] none
        ["ar", "sd", "ti-mcsd", "ti-mcsd+stop_model", "hf-assisted-static"])
    prompt_lookup_tokens: PosInt = 10  # transformers' prompt_lookup_num_tokens
    bootstrap_resamples: PosInt = 10000  # paired bootstrap over prompts (95% intervals)
    export: Path = paths.EXPORT
    train: Path = paths.TRAIN
    train_metrics: Path = paths.METRICS / "train.json"
    draft_metrics: Path = paths.METRICS / "draft.json"
    assistant_draft: str | None = "data/draft/sweep/compact-l2-v4096"
    metrics: Path = paths.METRICS / "bench.json"
    plots: Path = paths.METRICS / "bench_plots"


class Params(Section):
    """The whole of params.yaml; `source` is the file it came from (for messages)."""

    models: ModelsConfig = ModelsConfig()
    costs: CostsConfig = CostsConfig()
    sizes: SizesConfig = SizesConfig()
    decode: DecodeParams = DecodeParams()
    prompts: PromptsConfig = PromptsConfig()
    draft: DraftConfig = DraftConfig()
    mlflow: MLflowConfig = MLflowConfig()
    collect: CollectConfig = CollectConfig()
    train: StopTrainConfig = StopTrainConfig()
    export: ExportConfig = ExportConfig()
    bench: BenchConfig = BenchConfig()
    profiles: dict[str, dict[str, Any]] = {}


def validate(raw: dict[str, Any], source: str = "params.yaml") -> Params:
    """The typed params of a parsed params file, its profiles checked the same way; a
    SpecstopError (one line: file, dotted key, what was expected) otherwise."""
    params = _checked(raw, source, "")
    for name in params.profiles:
        _checked(apply_profile(raw, name, source), source, f"{PROFILES}.{name}.")
    return params


def with_overrides(params: Params, source: str, **sections: dict[str, Any]) -> Params:
    """`params` with some keys of some sections replaced (CLI flags: `--max-new-tokens 8` is
    `decode={"max_new_tokens": 8}`; nested mappings merge key by key, as a profile's:
    `export={"settle": {"prompts": 8}}`), checked as the file is; errors name the flag."""
    raw = params.model_dump(exclude={PROFILES}, exclude_unset=True)
    for name, values in sections.items():
        raw[name] = _merge(raw.get(name, {}), values)
    flags = {(name, key) for name, values in sections.items() for key, value in values.items()
             if not isinstance(value, dict)}  # a nested mapping's errors name its keys
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        error = err.errors()[0]
        loc = tuple(error["loc"])
        if error["type"] == CROSS_KEY:  # a rule over several keys: its message names the key
            key, _, rest = error["msg"].partition(": ")
            if (*loc[:1], key) in flags:
                raise SpecstopError(f"--{key.replace('_', '-')}: {rest}") from None
        if loc[:2] in flags:
            raise SpecstopError(f"--{str(loc[1]).replace('_', '-')}: "
                                f"{problem(Params, error)}") from None
        raise SpecstopError(f"{source}: {dotted(loc)}: {problem(Params, error)}") from None


def apply_profile(raw: dict[str, Any], name: str, source: str = "params.yaml") -> dict[str, Any]:
    """The raw params with profile `name` merged in (mappings merge key by key, anything else
    is replaced) and the profiles dropped."""
    profiles = raw.get(PROFILES) or {}
    if not isinstance(profiles.get(name), dict):
        raise SpecstopError(f"{source}: {PROFILES}: no profile '{name}' "
                            f"(known: {', '.join(profiles) or 'none'})")
    return _merge({k: v for k, v in raw.items() if k != PROFILES}, profiles[name])


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for key, value in override.items():
            out[key] = _merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def _checked(raw: dict[str, Any], source: str, prefix: str) -> Params:
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        error = err.errors()[0]
        raise SpecstopError(f"{source}: {prefix}{dotted(error['loc'])}: "
                            f"{problem(Params, error)}") from None
