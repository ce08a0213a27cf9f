"""``model.generate()`` for every family: argument resolution (call > generation_config > family defaults),
validation, and the call into the block-wise sampler."""

from __future__ import annotations

import json
import operator
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME, cached_file, logging

from .peft_rows import drop_adapter_name_hooks
from .sampler import DiffusionGenerationOutput, SamplingSettings, diffusion_generate, steps_for_dream
from .sampling import checked_cfg_scale

logger = logging.get_logger(__name__)

_DREAM_ALGS = {"origin": "origin", "maskgit_plus": "low_confidence_static", "topk_margin": "topk_margin",
               "entropy": "entropy"}
_ARGUMENTS = ("max_new_tokens", "block_length", "denoising_steps", "remasking_strategy", "confidence_threshold",
              "temperature", "top_k", "top_p", "use_cache", "steps", "alg", "alg_temp", "eps", "cfg_scale",
              "eos_token_id", "pad_token_id", "stop_token_ids", "return_dict_in_generate", "cuda_graphs",
              "max_length", "do_sample")


UNSUPPORTED_CONFIG_FIELDS = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "min_length": 0, "min_new_tokens": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "guidance_scale": None, "max_time": None, "stop_strings": None,
    "output_scores": False, "output_logits": False, "watermarking_config": None, "prompt_lookup_num_tokens": None,
    "output_attentions": False, "output_hidden_states": False, "top_h": None, "dola_layers": None,
    "force_words_ids": None, "constraints": None, "token_healing": False, "cache_implementation": None,
    "remove_invalid_values": False, "renormalize_logits": False, "low_memory": False, "use_mtp": False,
}
"""transformers ``GenerationConfig`` fields that change autoregressive decoding and that diffusion decoding does not
implement, with their neutral values (``None`` is neutral too). As call arguments they are unknown (a TypeError); in
a generation config (the call's or the model's) a value other than these is a ValueError rather than ignored."""


def _integer(name: str, value) -> int:
    """``value`` as an ``int``: Python and numpy integers and 0-d integer tensors pass; a float (even 4.0), a bool
    or anything else is a ValueError naming ``name`` (``int()`` would truncate 4.7 silently)."""
    if not isinstance(value, bool) and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool"):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r}.")


def _warn_idle_steps(steps: int, from_call: bool, max_new_tokens: int) -> None:
    """Dream's linspace schedule with more ``steps`` than tokens runs a forward pass for every step, most of which
    commit no token (as Dream's own sampler does): the released generation config's ``steps=512`` on a short
    generation costs 512 forwards."""
    source = "" if from_call else " (from the model's generation config)"
    logger.warning_once(f"steps={steps}{source} is more than the {max_new_tokens} tokens to generate: the steps "
                        "schedule (Dream's) runs a forward pass per step, so most of them commit no token. Pass "
                        "steps=max_new_tokens (one token a step on average) or fewer to decode in fewer forward "
                        "passes.")


def _warn_unread(kwargs: dict, strategy: str, schedule: str) -> None:
    """Warn about a call's ``confidence_threshold`` or ``eps`` that this decoding does not read (the first is
    ``low_confidence_dynamic``'s, the second the linspace schedule's of Dream's ``steps`` / ``alg``), rather than
    ignore it without a word. A warning, not an error: a config file layered under command-line options (an eval
    recipe's threshold beneath ``--remasking_strategy low_confidence_static``) passes both on, as dLLM-RL's configs
    give a threshold with every strategy. A generation config's value is a default for the decodings that read it."""
    threshold, eps = kwargs.get("confidence_threshold"), kwargs.get("eps")
    if threshold is not None and strategy != "low_confidence_dynamic":
        logger.warning_once(f"confidence_threshold={threshold!r} is read by remasking_strategy="
                            f"'low_confidence_dynamic' only; this call decodes with {strategy!r}, which ignores it.")
    if eps is not None and schedule != "linspace":
        logger.warning_once(f"eps={eps!r} is read by Dream's linspace schedule only (steps / alg over the whole "
                            "generation); this call decodes block by block (denoising_steps), which ignores it.")


def _token_ids(name: str, value) -> list[int]:
    """One token id (int, numpy integer, 0-d tensor) or several (list, tuple, 1-d tensor or array) as ints."""
    try:
        return [_integer(name, value)]
    except ValueError:
        pass
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}.")
    try:
        items = value.flatten().tolist() if hasattr(value, "flatten") and getattr(value, "ndim", 0) else list(value)
    except TypeError:
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}.") from None
    return [_integer(name, item) for item in items]


def padded_without_mask(input_ids: object, pad_token_id: int | None) -> bool:
    """Whether a batch given without its attention mask looks padded: its rows start (left padding) or end (right
    padding) with different numbers of ``pad_token_id``. Equal numbers are no sign of padding: a pad token that is
    also the BOS token starts every row once."""
    if pad_token_id is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or len(input_ids) < 2:
        return False
    is_pad = (input_ids == pad_token_id).int()
    leading, trailing = is_pad.cumprod(1).sum(1), is_pad.flip(1).cumprod(1).sum(1)
    return bool((leading != leading[0]).any() or (trailing != trailing[0]).any())


class DiffusionGenerationMixin:
    """Adds diffusion ``generate`` to a model that implements ``DiffusionModelMixin``."""

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                             *args, **kwargs):
        """Load ``generation_config.json`` on ``from_pretrained`` (transformers calls this hook)."""
        if generation_config is not None:
            self.generation_config = generation_config
            return
        if pretrained_model_name_or_path is None:
            return
        keys = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        try:
            path = cached_file(pretrained_model_name_or_path, GENERATION_CONFIG_NAME,
                               **{k: kwargs[k] for k in keys if k in kwargs})
        except OSError:
            return
        if path is None:
            return
        values = json.loads(Path(path).read_text())
        if values.get("temperature") == 0 and values.get("do_sample") is not True:
            # greedy (Dream's release: temperature 0.0, no do_sample), in the form transformers accepts: it refuses
            # to save a temperature without do_sample once the config is changed (TRL sets its pad_token_id)
            values = {**{k: v for k, v in values.items() if k != "temperature"}, "do_sample": False}
        config = GenerationConfig.from_dict(values)
        for name, value in values.items():  # keep the diffusion fields (block_length, denoising_steps, ...)
            if not name.startswith("_") and getattr(config, name, None) is None:
                setattr(config, name, value)
        # saved back as it was, `_from_model_config: true` (LLaDA's and Dream's released files) would make a plain
        # `GenerationConfig.from_pretrained` drop every field it does not know: the diffusion ones
        config._from_model_config = False
        config._original_object_hash = hash(config)  # as loaded: unmodified, so saving it back only warns
        self.generation_config = config

    def _family_defaults(self) -> dict:
        block = self.block_size or 32
        return {"max_new_tokens": 128, "block_length": block,
                "remasking_strategy": "low_confidence_static", "confidence_threshold": 0.9,
                "top_k": None, "top_p": None, "alg_temp": None, "eps": 1e-3, "cfg_scale": 0.0, "cuda_graphs": "auto"}

    def _resolve_settings(self, kwargs: dict, prompt_width: int = 0) -> tuple[SamplingSettings, bool]:
        """Each argument from the call, else ``generation_config``, else the family default. ``prompt_width``: the
        columns of ``input_ids``, which transformers' ``max_length`` counts."""
        unknown = set(kwargs) - set(_ARGUMENTS) - {"generation_config", "generator"}
        if unknown:
            raise TypeError(f"generate() got unexpected arguments {sorted(unknown)}; accepted: {_ARGUMENTS}.")
        # as transformers: a passed config's unset (None) fields come from the model's generation config
        passed, own = kwargs.pop("generation_config", None), getattr(self, "generation_config", None)
        configs = [c for c in (passed, own) if c is not None]
        defaults = self._family_defaults()

        def from_config(name):
            return next((value for value in (getattr(c, name, None) for c in configs) if value is not None), None)

        for name, neutral in UNSUPPORTED_CONFIG_FIELDS.items():
            value, own_value = getattr(passed, name, None), getattr(own, name, None)
            if value is not None and value != neutral:
                raise ValueError(f"generation_config sets {name}={value!r}, which diffusion decoding does not "
                                 f"implement (transformers' autoregressive decoding option); leave it unset"
                                 f"{'' if neutral is None else f' or {neutral!r}'}.")
            if value is None and own_value is not None and own_value != neutral:
                # a checkpoint's file (e.g. Qwen2.5's repetition_penalty 1.05): every caller would fail on it
                logger.warning_once(f"model.generation_config sets {name}={own_value!r}, which diffusion decoding "
                                    "does not implement (transformers' autoregressive decoding option): ignored.")

        def pick(name, default=None):  # ``default`` for the names without a family default
            if kwargs.get(name) is not None:
                return kwargs[name]
            value = from_config(name)
            return value if value is not None else defaults.get(name, default)

        max_new_tokens = self._max_new_tokens(kwargs, from_config, prompt_width)
        if max_new_tokens is None:
            max_new_tokens = defaults["max_new_tokens"]
        max_new_tokens = _integer("max_new_tokens", max_new_tokens)
        block_length = _integer("block_length", pick("block_length"))
        strategy = pick("remasking_strategy")
        # default: one token per step
        schedule, steps = "uniform", _integer("denoising_steps", pick("denoising_steps", block_length))
        # the call's block-wise arguments win over Dream's `alg` / `steps` from the config (and vice versa)
        blockwise_call = kwargs.get("remasking_strategy") is not None or kwargs.get("denoising_steps") is not None
        alg = kwargs.get("alg") or (None if blockwise_call else from_config("alg"))
        # Dream's whole-generation steps: the call's, else the config's (a config's `steps` alone means Dream's
        # default alg, "origin", as in Dream's own generation config)
        dream_steps = kwargs.get("steps") if kwargs.get("steps") is not None else (
            None if blockwise_call else from_config("steps"))
        if kwargs.get("alg") is not None and kwargs.get("remasking_strategy") is not None:
            raise ValueError("give either alg (Dream's name) or remasking_strategy, not both.")
        if kwargs.get("steps") is not None and kwargs.get("denoising_steps") is not None:
            raise ValueError("give either steps (over the whole generation, Dream's) or denoising_steps (per block), "
                             "not both.")
        if alg is not None or dream_steps is not None:
            # Dream's published arguments: `steps` over the whole generation, `alg` confidences, linspace schedule.
            if alg is not None and alg not in _DREAM_ALGS:
                raise ValueError(f"unknown alg {alg!r}; Dream's algorithms are {sorted(_DREAM_ALGS)}.")
            if alg is not None or kwargs.get("remasking_strategy") is None:
                strategy = _DREAM_ALGS[alg or "origin"]
            schedule = "linspace"
            block_causal = self.block_size is not None
            if not block_causal and kwargs.get("block_length") is None and from_config("block_length") is None:
                # Dream's one block; a block-causal model (SDAR) keeps its block: block_length is its attention block
                block_length = max_new_tokens
            if kwargs.get("denoising_steps") is not None:
                steps = _integer("denoising_steps", kwargs["denoising_steps"])
            else:
                if dream_steps is None and block_causal:
                    steps = block_length  # Dream's default steps = max_new_tokens: one token per step on average
                else:
                    steps = steps_for_dream(max_new_tokens if dream_steps is None else _integer("steps", dream_steps),
                                            max_new_tokens, block_length)
                    if steps > block_length:
                        _warn_idle_steps(int(dream_steps), kwargs.get("steps") is not None, max_new_tokens)
        cfg_scale = checked_cfg_scale(pick("cfg_scale"))
        # unset in the call and the generation configs (the released SDAR/TraDo generation_config.json): SDAR's exact
        # cache (in float32 the same tokens, fewer operations; in bf16 rounding may flip a near-tie), as transformers'
        # generate() defaults to its cache. Classifier-free guidance runs without one: there only the call's counts
        # (a generation config's `use_cache`, which transformers copies from config.use_cache into every model's, is
        # a default, not a request). On LLaDA / Dream True means none: their approximate caches are opt-in by name
        use_cache = (kwargs.get("use_cache") or False) if cfg_scale else pick("use_cache", True)
        if cfg_scale and kwargs.get("cfg_scale") is None and use_cache not in (False, "none"):
            raise ValueError(f"the generation config sets cfg_scale={cfg_scale} (classifier-free guidance, which runs "
                             f"without a KV cache) and the call asks for a cache (use_cache={use_cache!r}): pass "
                             "cfg_scale=0 to decode with the cache, or use_cache=False.")
        if isinstance(use_cache, str):
            cache_mode = use_cache
        elif use_cache and self.block_size is not None:
            cache_mode = "exact"
        else:  # the approximate LLaDA/Dream caches are opt-in by name only
            cache_mode = "none"
        temperature = pick("temperature")
        do_sample = kwargs.get("do_sample")
        if do_sample is None and kwargs.get("temperature") is None:
            do_sample = from_config("do_sample")
        if do_sample is not None:  # read by truth value, as transformers does (0, numpy and tensor booleans)
            do_sample = bool(do_sample)
        if do_sample is True and temperature is not None and float(temperature) == 0.0:
            raise ValueError("do_sample=True with temperature 0 (the call's or a generation config's) would decode "
                             "greedily: pass a temperature > 0, or do_sample=False.")
        if do_sample is False:  # transformers: do_sample=False is greedy whatever the temperature
            temperature = 0.0
        elif temperature is None:  # do_sample=True samples at temperature 1; nothing set is greedy (transformers)
            temperature = 1.0 if do_sample else 0.0
        # the first place (call, passed config, model's config) that names stop ids decides; there stop_token_ids
        # (the full list) beats eos_token_id
        stop = None
        for place in (kwargs, *configs):
            named = {n: place.get(n) if isinstance(place, dict) else getattr(place, n, None)
                     for n in ("stop_token_ids", "eos_token_id")}
            name = next((n for n, ids in named.items() if ids is not None), None)
            if name is not None:
                stop = _token_ids(name, named[name])
                break
        if stop is None:
            eos = getattr(self.config, "eos_token_id", None)
            stop = [] if eos is None else _token_ids("eos_token_id", eos)
        pad = pick("pad_token_id")
        if pad is None:
            pad = getattr(self.config, "pad_token_id", None)
        if pad is None:
            pad = stop[0] if stop else 0
        # Dream's alg_temp: a call's applies to the strategy the call runs (SamplingSettings refuses it where it would
        # do nothing); a generation config's only to a Dream `alg` (the call's or the config's), so that it never
        # changes a remasking_strategy chosen by name (e.g. the call's low_confidence_dynamic)
        alg_temp = kwargs.get("alg_temp")
        if alg_temp is None:
            alg_temp = from_config("alg_temp") if alg is not None else defaults["alg_temp"]
        _warn_unread(kwargs, strategy, schedule)
        top_k = None if pick("top_k") is None else _integer("top_k", pick("top_k"))
        top_p = pick("top_p")
        if isinstance(top_p, torch.Tensor) and top_p.dim() == 0:
            top_p = top_p.item()  # a 0-d tensor, as temperature and top_k take
        settings = SamplingSettings(
            max_new_tokens=max_new_tokens, block_length=block_length, denoising_steps=steps,
            remasking_strategy=strategy, confidence_threshold=pick("confidence_threshold"),
            temperature=float(temperature or 0.0), top_k=top_k, top_p=top_p, cache_mode=cache_mode,
            stop_token_ids=tuple(stop), schedule=schedule, eps=float(pick("eps")),
            alg_temp=alg_temp, cfg_scale=cfg_scale,
            gumbel_float64=self.config.model_type == "llada", raw_confidence=self.config.model_type == "llada",
            top_p_first=self.top_p_first,
            pad_token_id=_integer("pad_token_id", pad),
            cuda_graphs=pick("cuda_graphs"),
        )
        return settings, bool(pick("return_dict_in_generate"))

    def _num_return_sequences(self, kwargs: dict) -> int:
        """Pop transformers' ``num_return_sequences`` (call, else ``generation_config``; default 1): the sequences per
        prompt. A config's value was ignored (one sequence per prompt) while a call's was refused."""
        value = kwargs.pop("num_return_sequences", None)
        for config in (kwargs.get("generation_config"), getattr(self, "generation_config", None)):
            if value is None and config is not None:
                value = getattr(config, "num_return_sequences", None)
        if value is None:
            return 1
        value = _integer("num_return_sequences", value)
        if value < 1:
            raise ValueError(f"num_return_sequences must be a positive integer, got {value}.")
        return value

    @staticmethod
    def _max_new_tokens(kwargs: dict, from_config, prompt_width: int) -> int | None:
        """``max_new_tokens``, or transformers' ``max_length`` (prompt columns + new tokens) less the prompt: from
        the call, then from the config; ``max_new_tokens`` wins at the same level."""
        for source in (kwargs.get, from_config):
            if source("max_new_tokens") is not None:
                return source("max_new_tokens")
            max_length = source("max_length")
            if max_length is not None:
                max_length = _integer("max_length", max_length)
                if max_length <= prompt_width:
                    raise ValueError(f"max_length ({max_length}) leaves no room after the prompt ({prompt_width} "
                                     "columns); set max_new_tokens instead.")
                return max_length - prompt_width
        return None

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs) -> dict:
        """transformers' per-step input hook. peft's ``PeftModelForCausalLM`` (``LoraConfig(task_type="CAUSAL_LM")``,
        ``AutoPeftModelForCausalLM``) reads it when it wraps a model; diffusion ``generate`` does not call it."""
        return {"input_ids": input_ids, **kwargs}

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Diffusion decoding, block by block.

        Arguments (each also read from ``generation_config`` / ``generation_config.json``):
        ``max_new_tokens`` (or transformers' ``max_length``: prompt columns + new tokens); ``block_length``;
        ``denoising_steps`` (per block; default ``block_length``); ``remasking_strategy``
        (``sequential``, ``low_confidence_static``, ``low_confidence_dynamic``, ``random``, ``topk_margin``,
        ``entropy``); ``confidence_threshold`` (dynamic); ``temperature`` (0 = greedy, else at least
        ``MIN_TEMPERATURE``, 1e-5; ``do_sample=False`` is greedy too; greedy when neither it nor ``do_sample`` is
        set anywhere, as in transformers); ``top_k``; ``top_p``; ``use_cache`` (True = SDAR's exact cache, the default
        there unless ``cfg_scale`` is set; for LLaDA/Dream only the names ``"prefix"`` / ``"dual"`` turn on the
        approximate Fast-dLLM-style caches, so a config's ``use_cache: true`` never changes their output);
        ``eos_token_id`` / ``stop_token_ids`` (each row stops after the block in which it produced one);
        ``cfg_scale`` (LLaDA classifier-free guidance); Dream's
        own ``steps``, ``alg``, ``alg_temp``, ``eps`` (linspace schedule; without ``block_length``, one block on
        LLaDA/Dream, the model's block size on SDAR; a generation config's ``alg_temp`` applies only with a Dream
        ``alg``, a call's to any strategy but ``sequential``, and ``low_confidence_dynamic`` keeps its threshold
        under it); ``generator`` (a ``torch.Generator``, or a list with one per row so that a row's sample does
        not depend on its batch); ``num_return_sequences`` (as in transformers: each prompt's sequences are
        consecutive rows; a generator list has one generator per returned row); ``synced_gpus`` (as in
        transformers: every process runs the same number of forwards, which FSDP and ZeRO-3 need; ``None``, the
        default, decides as transformers does); ``return_dict_in_generate`` to get
        a ``DiffusionGenerationOutput`` with the trajectory; ``cuda_graphs`` (``"auto"``, the default: on CUDA,
        replay the denoising steps of SDAR's exact cache and of LLaDA's / Dream's prefix and dual caches as CUDA
        graphs, and decode eagerly where a graph cannot apply: the CPU, no cache, a single shared generator with
        sampling, classifier-free guidance, mixed-adapter batches, FSDP / ZeRO-3 forwards, SDAR-MoE and LLaDA-MoE,
        whose expert dispatch depends on the data; ``"off"``: always eager; any other value is a ValueError).

        Sizes (``max_new_tokens``, ``block_length``, ``denoising_steps``, ``steps``, ``max_length``) and token ids
        are integers (Python, numpy, 0-d tensors; ``eos_token_id`` / ``stop_token_ids`` also lists or 1-d tensors);
        floats and bools are a ValueError naming the argument.

        Prompts are left-padded (``attention_mask`` 0 on padding); every row is decoded exactly as it would be
        alone. Returns ``sequences`` (prompt + completion) or the output object.
        """
        try:
            return self._generate(input_ids, attention_mask, **kwargs)
        except BaseException:
            # peft's mixed-adapter call (`adapter_names`) removes its per-row hooks only when generate returns: a
            # refused call left every later forward and generate() on that call's adapters
            drop_adapter_name_hooks(self)
            raise

    def _pad_token_id(self) -> int | None:
        """The pad token's id: the generation config's, else the model config's."""
        pad = getattr(self.generation_config, "pad_token_id", None)
        return pad if pad is not None else getattr(self.config, "pad_token_id", None)

    def _generate(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, **kwargs):
        """``generate``'s body (see there)."""
        generator = kwargs.pop("generator", None)
        synced_gpus = kwargs.pop("synced_gpus", None)
        if synced_gpus is not None and not isinstance(synced_gpus, bool):
            raise ValueError(f"synced_gpus must be True, False or None (automatic), got {synced_gpus!r}.")
        passed = kwargs.get("generation_config")
        if passed is not None and not isinstance(passed, GenerationConfig):
            raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(passed).__name__}: "
                            "pass GenerationConfig(**settings), or the settings as keyword arguments.")
        copies = self._num_return_sequences(kwargs)
        if copies > 1 and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            # as transformers: each prompt's sequences are consecutive rows (a generator list has one per row)
            input_ids = input_ids.repeat_interleave(copies, 0)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                attention_mask = attention_mask.repeat_interleave(copies, 0)
        width = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) and input_ids.dim() else 0
        settings, return_dict = self._resolve_settings(kwargs, width)
        if attention_mask is None and padded_without_mask(input_ids, self._pad_token_id()):
            logger.warning_once("generate() got no attention_mask, but the rows of input_ids start or end with "
                                f"different numbers of the pad token (id {self._pad_token_id()}): its padding is read "
                                "as prompt. Pass the tokenizer's attention_mask.")
        if copies > 1 and not settings.draws_randomness:
            raise ValueError(f"num_return_sequences={copies} with greedy decoding would return {copies} identical "
                             "copies of each sequence (transformers refuses it too): sample (a temperature > 0, "
                             "do_sample=True) or use num_return_sequences=1.")
        # every module's own mode comes back, through train() (overrides run: peft's DoRA clears its cache there);
        # self.train(was_training) alone would put a submodule the caller keeps in eval mode, e.g. a frozen block
        # without dropout, back in train mode. modules() lists parents first, so a child's train() comes last.
        modes = [(module, module.training) for module in self.modules()]
        self.eval()
        try:
            output = diffusion_generate(self, input_ids, attention_mask, settings, generator, synced_gpus)
        finally:
            self.train(modes[0][1])
            for module, training in modes[1:]:
                if module.training != training:
                    module.train(training)
        return output if return_dict else output.sequences


__all__ = ["DiffusionGenerationMixin", "DiffusionGenerationOutput"]
