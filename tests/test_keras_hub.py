"""KerasHub families under DP: full fine-tuning and LoRA, exact.

Each family's backbone is built offline from constructor arguments (tiny
sizes, random weights, no preset download) the way users build them, with a
small classification head (the sequence mean-pooled, plus the pooled output
where the backbone has one; a ResNet's feature map pooled). One DP `fit`
step of `tf_pxg.keras.make_private(model)` with `noise_multiplier=0` and
`SGD(1)` must equal `w - mean_b clip(g_b)` from the plain `tf.GradientTape`
loop over single examples with the same loss
(`tf_pxg.testing.reference_per_example_gradients`,
`expected_dp_sgd_weights`), to 1e-4 of each variable's update; the clip is
the median global norm, so some examples are clipped and some not. Full
fine-tuning and LoRA share one build per family (`check_full_then_lora`):
the full step is checked, then the built weights are restored, LoRA is
enabled on the same backbone and the LoRA step checked, each mode with its
own reference and traced step; a failure names the mode. The steps run
on `fit`'s default data path, Poisson batches (of rate 1 here: all B
examples, in a physical batch padded with masked rows).

The same full step is also checked under XLA (`jit_compile=True`) for
GPT-2, Llama, ViT and BERT, eagerly (`run_eagerly=True`) for GPT-2 and
DeBERTa-v3, and as a causal LM (the backbone's tied token embedding as the
head; each example's loss the mean over its positions of the next-token
cross-entropy, padding masked through `sample_weight` as KerasHub's
CausalLM does) for GPT-2, Llama and Gemma (LoRA too for GPT-2 and Gemma).
A noisy `fit` on Poisson batches of rate 1/2 runs (finite, moved weights,
ε accounted) for BERT in full fine-tuning and GPT-2 with LoRA: the noise,
the varying batch sizes and the accountant are family-independent.

Full fine-tuning and LoRA, exact, for the 21 main families; FNet (token
mixing by a 2-D FFT), Swin (attention windows folded into the batch axis,
`[B*W*s, d]` rows split into `[B*W, s, d]`) and RWKV-7 (its time mix
writes each step's `[B, H, N]` output into a `TensorArray`, a TensorList
followed element-wise: `tests/test_tensor_lists.py`) among them. T5's,
FNet's and Swin's projections are not named as `enable_lora`'s defaults:
their LoRA targets are T5's query/value projectors, FNet's embedding
projection (before the FFT mixing) and FFN, Swin's fused qkv.

41 more families (`slow`), full fine-tuning, exact: Bloom, Falcon,
GPT-NeoX, XLM-RoBERTa, RoFormer-V2, ESM, ESM-2, Llama 3, Qwen 2, Qwen 3.5
(a linear-attention and a gated full-attention layer), Gemma 3n (one
sliding-window layer: AltUp, LAuReL, per-layer inputs), Gemma 4, SmolLM 3,
T5Gemma, T5Gemma 2, EdRec, DeiT, DINOv2, DINOv3, ViTDet, MiT (SegFormer's
encoder), VGG, the CLIP, SigLIP and MetaCLIP 2 text and vision towers,
VideoPrism, PARSeq, DepthAnything (two DINOv2 layers, a neck reassembling
one feature map up and one down), audio (Whisper on mel features,
Moonshine on a raw waveform), vision-language (PaliGemma, BLIP-2),
mixture-of-experts (GPT-OSS; Mixtral, Qwen-MoE and Qwen 3-MoE with
`router_aux_loss_coefficient=0`), Segment Anything (image encoder, point
and box prompts, mask decoder) and Stable Diffusion 3's MMDiT, their
inputs built from the backbone's `Input` specs. LoRA, exact, for the 8 of
them whose LoRA targets are their own layer names (`MORE_LORA`: GPT-NeoX's
fused `query_key_value`, the Dense `q_dense_layer`/`v_dense_layer` of ESM,
ESM-2 and RoFormer-V2, the Dense `q_proj`/`v_proj` of SmolLM 3, Gemma 3n
and DINOv3, MMDiT's `attention_qkv`/`attention_proj`). For the other 29,
`enable_lora` (KerasHub's default `query`/`value` targets) is checked to
make LoRA layers, each of a form (`LORA_FORMS`: its class and, for an
EinsumDense, its equation up to the letters' names) whose LoRA step a main
family checks; their own LoRA step would add no code path: a LoRA kernel
is `kernel + lora_kernel_a @ lora_kernel_b * scale`, read by the same
einsum or matmul as in full fine-tuning (whose per-example rule, and every
path from the loss to it, the family's full step checks), and the product
of the two factors is the same parameter-only computation in every layer
of a form. MiT, SAM, ViTDet and VGG have no layer `enable_lora` can target
by name (a test checks that).

Refused by name: Mixtral's batch-level router loss (`add_loss`) when on,
XLNet's attention mask (KerasHub reshapes the `[B, T]` padding mask to
`[T, B]`, which mixes examples), CLIP's joint contrastive logits (in-batch
negatives), and BatchNormalization (ResNet, D-FINE) in full fine-tuning.

The families exercise the engine's parameter copies along the batch axis
(`tf_pxg.rules.copies`): KerasHub's `PositionEmbedding` broadcasts its
table to the batch (BERT, DistilBERT, RoBERTa, ALBERT, ELECTRA, GPT-2, OPT,
BART), ViT tiles its class token and concatenates it with the patches,
DeBERTa-v3 repeats its relative table per example. LoRA is
`backbone.enable_lora(rank)` (base weights frozen), with the zero-initialised
`lora_kernel_b` randomised so that every LoRA weight has a gradient. ResNet
(BatchNormalization) is refused by name in full fine-tuning; with LoRA its
whole backbone is frozen (BN in inference) and the head trains exactly.

Skipped when keras-hub is not installed (`pip install "tf_pxg[hub]"`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Union

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import _compat
from tf_pxg import testing as pxg_testing

keras_hub = pytest.importorskip("keras_hub")
models = keras_hub.models
# CLIP's and SigLIP's towers: users reach them as `backbone.vision_encoder`
# of a preset; built offline here, their classes come from keras_hub.src.
from keras_hub.src.models.clip.clip_text_encoder import CLIPTextEncoder  # noqa: E402,E501
from keras_hub.src.models.clip.clip_vision_encoder import CLIPVisionEncoder  # noqa: E402,E501
from keras_hub.src.models.siglip.siglip_text_encoder import SigLIPTextEncoder  # noqa: E402,E501
from keras_hub.src.models.siglip.siglip_vision_encoder import SigLIPVisionEncoder  # noqa: E402,E501
from keras_hub.src.models.metaclip_2.metaclip_2_text_encoder import MetaCLIP2TextEncoder  # noqa: E402,E501
from keras_hub.src.models.metaclip_2.metaclip_2_vision_encoder import MetaCLIP2VisionEncoder  # noqa: E402,E501
# Stable Diffusion 3's diffusion transformer: `backbone.diffuser` of a preset.
from keras_hub.src.models.stable_diffusion_3.mmdit import MMDiT  # noqa: E402,E501

B, T, VOCAB, CLASSES = 4, 6, 32, 3
TEXT = dict(num_layers=1, hidden_dim=8, intermediate_dim=16)
ENCODER = dict(TEXT, vocabulary_size=VOCAB, num_heads=2, dropout=0.0,
               max_sequence_length=8)
DECODER = dict(TEXT, vocabulary_size=VOCAB, num_query_heads=2,
               num_key_value_heads=1)


@dataclasses.dataclass(frozen=True)
class Family:
  """How to build one family's backbone, a batch of its inputs, the
  outputs its head reads and its LoRA targets."""
  build: Callable[[], keras.Model]
  # "text", "seq2seq", "image", "audio", "spec", or (backbone, rng) -> x.
  inputs: Union[str, Callable] = "text"
  # backbone -> the outputs the head pools (default `backbone(inputs)`).
  outputs: Optional[Callable[[keras.Model], Any]] = None
  # `enable_lora`'s `target_layer_names` (default: the backbone's own).
  lora_targets: Optional[Sequence[str]] = None


def _rwkv7() -> keras.Model:
  """RWKV-7 (a recurrence whose time steps are written into a TensorArray).
  At KerasHub's initialisation its time- and channel-mix weights get
  updates of 1e-11 to 1e-5 in this step, below float32's resolution of the
  weights themselves, so the step would check them only to the absolute
  tolerance: they are redrawn N(0, 0.5^2) (seeded) so that the recurrence
  moves them measurably."""
  backbone = models.RWKV7Backbone(
      hidden_size=8, head_size=4, num_layers=1, vocabulary_size=VOCAB,
      intermediate_dim=16, gate_lora=4, mv_lora=4, aaa_lora=4, decay_lora=4)
  rng = np.random.default_rng(3)
  for v in backbone.weights:
    if "RWKV_TIME_MIX" in v.path or "RWKV_CMIX" in v.path:
      v.assign(0.5 * rng.standard_normal(v.shape).astype(v.dtype))
  return backbone


FAMILIES: Dict[str, Family] = {
    "gemma": Family(lambda: models.GemmaBackbone(
        **DECODER, head_dim=4)),
    "gemma3": Family(lambda: models.Gemma3Backbone(
        **DECODER, head_dim=4, image_size=16)),
    "llama": Family(lambda: models.LlamaBackbone(**DECODER)),
    "mistral": Family(lambda: models.MistralBackbone(**DECODER)),
    "qwen": Family(lambda: models.QwenBackbone(**DECODER)),
    "qwen3": Family(lambda: models.Qwen3Backbone(**DECODER, head_dim=4)),
    "phi3": Family(lambda: models.Phi3Backbone(
        **dict(DECODER, num_key_value_heads=2))),
    # T5's, FNet's and Swin's projections are not named as `enable_lora`'s
    # defaults: LoRA on their own names (T5's query/value, FNet's embedding
    # projection before the FFT mixing and its FFN, Swin's fused qkv).
    "t5": Family(lambda: models.T5Backbone(
        vocabulary_size=VOCAB, num_heads=2, dropout=0.0, **TEXT),
                 inputs="seq2seq",
                 lora_targets=("query_projector", "value_projector")),
    "bert": Family(lambda: models.BertBackbone(**ENCODER)),
    "distil_bert": Family(lambda: models.DistilBertBackbone(**ENCODER)),
    "roberta": Family(lambda: models.RobertaBackbone(**ENCODER)),
    "albert": Family(lambda: models.AlbertBackbone(
        **ENCODER, embedding_dim=4)),
    "electra": Family(lambda: models.ElectraBackbone(
        **{("vocab_size" if k == "vocabulary_size" else k): v
           for k, v in ENCODER.items()}, embedding_dim=4)),
    "gpt2": Family(lambda: models.GPT2Backbone(**ENCODER)),
    "opt": Family(lambda: models.OPTBackbone(**ENCODER)),
    "bart": Family(lambda: models.BartBackbone(**ENCODER),
                   inputs="seq2seq"),
    "deberta_v3": Family(lambda: models.DebertaV3Backbone(
        **ENCODER, bucket_size=4)),
    "vit": Family(lambda: models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
        hidden_dim=8, mlp_dim=16), inputs="image"),
    # Token mixing by a 2-D FFT (FNet), attention windows folded into the
    # batch axis (Swin: [B*W*s, d] rows split into [B*W, s, d]).
    "f_net": Family(lambda: models.FNetBackbone(
        vocabulary_size=VOCAB, dropout=0.0, max_sequence_length=8, **TEXT),
                    lora_targets=("embedding_projection",
                                  "intermediate_dense")),
    "swin": Family(lambda: models.SwinTransformerBackbone(
        image_shape=(16, 16, 3), embed_dim=8, depths=[1, 1],
        num_heads=[2, 2], window_size=2, patch_size=4, drop_path=0.0),
                   inputs="image", lora_targets=("attention_qkv",)),
    # LoRA on its `value` projections (enable_lora's default names).
    "rwkv7": Family(_rwkv7),
    "resnet": Family(lambda: models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64], stackwise_num_blocks=[1],
        stackwise_num_strides=[1], block_type="basic_block",
        image_shape=(8, 8, 3)), inputs="image"),
}


def _text(rng, prefix=""):
  """Token ids with padding at the end of some examples (mask 0)."""
  ids = rng.integers(1, VOCAB, size=(B, T)).astype("int32")
  lengths = np.array([T, T - 2, T - 1, 3])[:B]
  mask = np.arange(T)[None, :] < lengths[:, None]
  return {f"{prefix}token_ids": ids * mask,
          f"{prefix}padding_mask": mask.astype("int32")}


def _from_specs(backbone: keras.Model, rng, length: int = T):
  """A batch built from the backbone's `keras.Input` specs: float inputs
  standard normal (an audio waveform, mel features, an image), integer ids
  in [1, VOCAB), positions 0..length-1, padding masks with the padding at
  the end of some examples (bool where the input is bool); each unknown
  axis `length`."""
  specs = backbone.input
  if not isinstance(specs, dict):
    specs = {t.name.split(":")[0]: t for t in tf.nest.flatten(specs)}
  lengths = np.array([length, length - 2, length - 1, 3])[:B]
  x = {}
  for name, spec in specs.items():
    shape = [B] + [length if d is None else d for d in spec.shape[1:]]
    if "mask" in name:
      mask = np.arange(shape[1])[None, :] < lengths[:, None]
      x[name] = mask.astype(str(spec.dtype))
    elif "position" in name:
      x[name] = np.broadcast_to(np.arange(shape[1]), shape).astype("int32")
    elif "int" in str(spec.dtype):
      x[name] = rng.integers(1, VOCAB, size=shape).astype("int32")
    else:
      x[name] = rng.standard_normal(shape).astype("float32")
  return next(iter(x.values())) if len(x) == 1 else x


def batch(backbone: keras.Model, kind: str, seed: int = 0):
  """A batch of B inputs in the structure `backbone` takes."""
  rng = np.random.default_rng(seed)
  if callable(kind):
    return kind(backbone, rng)
  if kind == "spec":
    return _from_specs(backbone, rng)
  if kind == "audio":  # Moonshine: a raw waveform, 1600 samples.
    x = _from_specs(backbone, rng)
    x["encoder_input_values"] = rng.standard_normal((B, 1600, 1)).astype(
        "float32")
    x["encoder_padding_mask"] = np.ones((B, 1600), bool)
    return x
  if kind == "image":
    shape = backbone.inputs[0].shape[1:]
    return rng.standard_normal((B, *shape)).astype("float32")
  if kind == "seq2seq":
    return {**_text(rng, "encoder_"), **_text(rng, "decoder_")}
  x = _text(rng)
  names = {t.name.split(":")[0] for t in tf.nest.flatten(backbone.input)}
  if any("segment_ids" in n for n in names):
    x["segment_ids"] = (np.arange(T)[None, :] >= T // 2).astype(
        "int32").repeat(B, 0)
  return {k: v for k, v in x.items()
          if any(n.endswith(k) or k in n for n in names)}


def classifier(backbone: keras.Model, outputs=None) -> keras.Model:
  """A functional classifier over `backbone` (its outputs, or
  `outputs(backbone)`): the sequence (or feature map) mean-pooled, with
  the pooled output where there is one."""
  out = backbone(backbone.input) if outputs is None else outputs(backbone)
  if isinstance(out, dict):
    seq = out.get("sequence_output", out.get("decoder_sequence_output"))
    pooled = out.get("pooled_output")
  else:
    seq, pooled = out, None
  if len(seq.shape) == 2:  # Already pooled (CLIP/SigLIP encoders).
    logits = keras.layers.Dense(CLASSES, name="head")(seq)
    return keras.Model(backbone.input, logits)
  pool = (keras.layers.GlobalAveragePooling2D() if len(seq.shape) == 4 else
          keras.layers.GlobalAveragePooling1D())
  h = pool(seq)
  if pooled is not None:  # Added, or concatenated if its width differs.
    h = (keras.layers.Add() if pooled.shape[-1] == h.shape[-1] else
         keras.layers.Concatenate())([h, pooled])
  logits = keras.layers.Dense(CLASSES, name="head")(h)
  return keras.Model(backbone.input, logits)


def _randomize_lora(model: keras.Model, rng) -> None:
  """LoRA's `B` factor starts at zero (so `A`'s gradient is zero)."""
  for v in model.trainable_variables:
    if v.path.endswith("lora_kernel_b"):
      v.assign(0.3 * rng.standard_normal(v.shape).astype(v.dtype))


def _build(name: str):
  """(model, backbone, inputs, labels) for one family, seeded."""
  keras.utils.set_random_seed(0)
  family = FAMILIES[name]
  backbone = family.build()
  model = classifier(backbone, family.outputs)
  x = batch(backbone, family.inputs)
  y = np.random.default_rng(2).integers(0, CLASSES, size=(B,))
  return model, backbone, x, y


def build(name: str, lora: bool):
  """(model, inputs, labels) for one family and mode, seeded."""
  model, backbone, x, y = _build(name)
  if lora:
    backbone.enable_lora(2, FAMILIES[name].lora_targets)
    _randomize_lora(model, np.random.default_rng(1))
  return model, x, y


_ERRORS: Dict[str, float] = {}


def _token_mean_loss(labels, logits):
  """A causal LM's per-example loss as Keras computes it under DP
  (`tf_pxg.keras.losses`): the token cross-entropies times the padding
  mask, averaged over the T positions. `labels` is (ids, mask)."""
  ids, mask = labels
  ce = keras.losses.sparse_categorical_crossentropy(ids, logits,
                                                    from_logits=True)
  return tf.reduce_mean(ce * tf.cast(mask, ce.dtype), axis=1)


def dp_step_error(model: keras.Model, x, y, sample_weight=None,
                  jit_compile=False, run_eagerly=False) -> float:
  """One noiseless DP `fit` step of `make_private(model)` against the
  reference; returns the worst error relative to each variable's update
  (`assert_dp_step_matches_reference`, which raises above 1e-4).

  The loss is the sparse cross-entropy from logits: of the class for a
  classifier, of each token weighted by `sample_weight` (the padding mask)
  and averaged over the positions for a causal LM."""
  xs = tf.nest.map_structure(tf.constant, x)
  if sample_weight is None:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None)
    labels = tf.constant(y)
  else:
    loss, labels = _token_mean_loss, (tf.constant(y),
                                      tf.constant(sample_weight))
  ref = pxg_testing.reference_per_example_gradients(
      loss, model, model.trainable_variables, xs, labels)
  clip = float(np.median(pxg_testing.per_example_global_norms(ref)))
  dp = dpk.make_private(model, l2_norm_clip=clip, noise_multiplier=0.0)
  dp.compile(optimizer=keras.optimizers.SGD(1.0),
             loss=keras.losses.SparseCategoricalCrossentropy(
                 from_logits=True), jit_compile=jit_compile,
             run_eagerly=run_eagerly)
  before = [v.numpy() for v in dp.trainable_variables]
  dp.fit(x, y, sample_weight=sample_weight, batch_size=B, epochs=1,
         verbose=0, shuffle=False)
  err = pxg_testing.assert_dp_step_matches_reference(
      dp.trainable_variables, before,
      pxg_testing.expected_dp_sgd_weights(before, ref, clip),
      names=[v.path for v in dp.trainable_variables])
  return err * 1e-4  # Relative to the update (the bound is 1e-4 of it).


# More families (the engine paths they take are covered above; these guard
# KerasHub's other variants), full fine-tuning and LoRA. Where the backbone
# names its query and value projections other than `enable_lora`'s
# defaults, the family passes its own names.
_QV_DENSE_LAYER = ("q_dense_layer", "v_dense_layer")  # ESM, RoFormer-V2
_QV_PROJ = ("q_proj", "v_proj")  # SmolLM 3, Gemma 3n, DINOv3
MORE_FAMILIES: Dict[str, Family] = {
    "bloom": Family(lambda: models.BloomBackbone(
        vocabulary_size=VOCAB, num_heads=2, **TEXT)),
    "falcon": Family(lambda: models.FalconBackbone(
        vocabulary_size=VOCAB, num_attention_heads=2, **TEXT)),
    "gpt_neox": Family(lambda: models.GPTNeoXBackbone(
        **ENCODER, rotary_percentage=0.5),
                       lora_targets=("query_key_value",)),
    "xlm_roberta": Family(lambda: models.XLMRobertaBackbone(**ENCODER)),
    "roformer_v2": Family(lambda: models.RoformerV2Backbone(
        vocabulary_size=VOCAB, num_heads=2, head_size=4, dropout=0.0,
        **TEXT), lora_targets=_QV_DENSE_LAYER),
    "esm2": Family(lambda: models.ESM2Backbone(
        vocabulary_size=VOCAB, num_heads=2, dropout=0.0, **TEXT),
                   lora_targets=_QV_DENSE_LAYER),
    "llama3": Family(lambda: models.Llama3Backbone(**DECODER)),
    "qwen2": Family(lambda: models.Qwen2Backbone(**DECODER)),
    "deit": Family(lambda: models.DeiTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
        hidden_dim=8, intermediate_dim=16), inputs="image"),
    "dinov2": Family(lambda: models.DINOV2Backbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
        hidden_dim=8, intermediate_dim=16), inputs="image"),
}
def _without_dropout(backbone: keras.Model) -> keras.Model:
  """MiT's attention has a fixed `Dropout(0.1)`: rate 0, so that the DP
  step and the batch-of-one reference draw no masks and can be compared
  (random layers under DP: `tests/test_model_zoo.py`)."""
  for layer in _compat.flatten_layers(backbone):
    if isinstance(layer, keras.layers.Dropout):
      layer.rate = 0.0
  return backbone


_SIGLIP = dict(num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16)
# One encoder and one decoder layer (T5Gemma and T5Gemma 2 take the same).
_T5GEMMA = dict(
    vocabulary_size=VOCAB, encoder_hidden_dim=8, encoder_intermediate_dim=16,
    encoder_num_layers=1, encoder_num_attention_heads=2,
    encoder_num_key_value_heads=1, encoder_head_dim=4,
    encoder_layer_types=["full_attention"], decoder_hidden_dim=8,
    decoder_intermediate_dim=16, decoder_num_layers=1,
    decoder_num_attention_heads=2, decoder_num_key_value_heads=1,
    decoder_head_dim=4, decoder_layer_types=["full_attention"])
# Audio, vision-language, mixture-of-experts and the other text and vision
# variants keras-hub 0.32 builds from a config; inputs from their `Input`
# specs ("spec"). CLIP and SigLIP are fine-tuned one tower at a time (their
# joint contrastive logits compare examples: see the refusal test below).
MORE_FAMILIES.update({
    "whisper": Family(lambda: models.WhisperBackbone(
        vocabulary_size=VOCAB, num_heads=2, num_mels=4,
        max_encoder_sequence_length=12, max_decoder_sequence_length=8,
        **TEXT), inputs="spec"),
    "moonshine": Family(lambda: models.MoonshineBackbone(
        vocabulary_size=VOCAB, filter_dim=8, encoder_num_layers=1,
        decoder_num_layers=1, hidden_dim=8, intermediate_dim=16,
        encoder_num_heads=2, decoder_num_heads=2), inputs="audio"),
    "paligemma": Family(lambda: models.PaliGemmaBackbone(
        vocabulary_size=VOCAB, image_size=8, num_layers=1,
        num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
        intermediate_dim=16, head_dim=4, vit_patch_size=4, vit_num_heads=2,
        vit_hidden_dim=8, vit_num_layers=1), inputs="spec"),
    "gpt_oss": Family(lambda: models.GptOssBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
        hidden_dim=8, intermediate_dim=16, num_key_value_heads=1,
        num_experts=2, top_k=1, head_dim=4)),
    "smollm3": Family(lambda: models.SmolLM3Backbone(
        vocabulary_size=VOCAB, hidden_dim=8, intermediate_dim=16,
        num_layers=1, num_attention_heads=2, num_key_value_heads=1,
        attention_bias=False, attention_dropout=0.0,
        rope_layer_enabled_list=[True], layer_types=["full_attention"],
        mlp_bias=False, layer_norm_epsilon=1e-6, max_position_embeddings=16,
        rope_theta=10000.0, partial_rotary_factor=1.0),
                      lora_targets=_QV_PROJ),
    "t5gemma": Family(lambda: models.T5GemmaBackbone(**_T5GEMMA),
                      inputs="spec"),
    "esm": Family(lambda: models.ESMBackbone(
        vocabulary_size=VOCAB, num_heads=2, dropout=0.0,
        max_sequence_length=8, **TEXT), lora_targets=_QV_DENSE_LAYER),
    "edrec": Family(lambda: models.EdRecBackbone(
        vocab_size=VOCAB, num_layers_enc=1, num_layers_dec=1, hidden_dim=8,
        intermediate_dim=16, num_heads=2), inputs="spec"),
    "clip_vision": Family(lambda: CLIPVisionEncoder(
        patch_size=4, image_shape=(8, 8, 3), **_SIGLIP), inputs="spec"),
    "clip_text": Family(lambda: CLIPTextEncoder(
        vocabulary_size=VOCAB, embedding_dim=8, max_sequence_length=8,
        **_SIGLIP), inputs="spec"),
    "siglip_vision": Family(lambda: SigLIPVisionEncoder(
        patch_size=4, image_shape=(8, 8, 3), **_SIGLIP), inputs="spec"),
    # Mixture of experts with the batch-level router loss off (a term
    # scaled by a constant 0 is accepted; on, it is refused: see below).
    "mixtral": Family(lambda: models.MixtralBackbone(
        **DECODER, num_experts=2, router_aux_loss_coef=0.0)),
    "qwen_moe": Family(lambda: models.QwenMoeBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
        moe_intermediate_dim=8, shared_expert_intermediate_dim=8,
        num_experts=2, top_k=1, router_aux_loss_coefficient=0.0)),
    "qwen3_moe": Family(lambda: models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
        moe_intermediate_dim=8, num_experts=2, top_k=1,
        router_aux_loss_coefficient=0.0)),
    "gemma4": Family(lambda: models.Gemma4Backbone(
        vocabulary_size=VOCAB, image_size=8, num_layers=2,
        num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
        intermediate_dim=16, head_dim=4, sliding_window_size=4,
        sliding_window_pattern=2), inputs="spec"),
    # One layer, sliding-window (a full-attention layer differs only by
    # its mask): AltUp, LAuReL and the per-layer inputs are all in it.
    "gemma3n": Family(lambda: models.Gemma3nBackbone(
        text_vocab_size=VOCAB, text_hidden_size=8, num_hidden_layers=1,
        pad_token_id=0, num_attention_heads=2, num_key_value_heads=1,
        head_dim=4, intermediate_size=[16],
        hidden_activation="gelu_approximate",
        layer_types=["sliding_attention"],
        sliding_window=4, rope_theta=10000.0, max_position_embeddings=16,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=4,
        altup_num_inputs=2, laurel_rank=2), inputs="spec",
                      lora_targets=_QV_PROJ),
    "t5gemma2": Family(lambda: models.T5Gemma2Backbone(**_T5GEMMA),
                       inputs="spec"),
    "qwen3_5": Family(lambda: models.Qwen3_5Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, head_dim=8, hidden_dim=8,
        intermediate_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=4, linear_value_head_dim=4)),
    "siglip_text": Family(lambda: SigLIPTextEncoder(
        vocabulary_size=VOCAB, embedding_dim=8, max_sequence_length=T,
        **_SIGLIP), inputs="spec"),
    "mit": Family(lambda: _without_dropout(models.MiTBackbone(
        layerwise_depths=[1], num_layers=1, layerwise_num_heads=[1],
        layerwise_sr_ratios=[1], max_drop_path_rate=0.0,
        layerwise_patch_sizes=[3], layerwise_strides=[2],
        image_shape=(8, 8, 3), hidden_dims=[8])), inputs="image"),
    "vgg": Family(lambda: models.VGGBackbone(
        stackwise_num_repeats=[1], stackwise_num_filters=[4],
        image_shape=(8, 8, 3)), inputs="image"),
    "vitdet": Family(lambda: models.ViTDetBackbone(
        hidden_size=8, num_layers=1, intermediate_dim=16, num_heads=2,
        global_attention_layer_indices=[0], image_shape=(16, 16, 3),
        patch_size=4, num_output_channels=8, window_size=2),
                     inputs="image"),
    "dinov3": Family(lambda: models.DINOV3Backbone(
        patch_size=4, num_layers=1, hidden_dim=8, num_heads=2,
        intermediate_dim=16, image_shape=(8, 8, 3), num_register_tokens=1),
                     inputs="image", lora_targets=_QV_PROJ),
})
# MetaCLIP 2's towers (one at a time, as CLIP's) and VideoPrism (a
# factorised video transformer: spatial then temporal layers over frames).
MORE_FAMILIES.update({
    "metaclip2_vision": Family(lambda: MetaCLIP2VisionEncoder(
        patch_size=4, image_shape=(8, 8, 3), **_SIGLIP), inputs="spec"),
    "metaclip2_text": Family(lambda: MetaCLIP2TextEncoder(
        vocabulary_size=VOCAB, embedding_dim=8, max_sequence_length=8,
        **_SIGLIP), inputs="spec"),
    "video_prism": Family(lambda: models.VideoPrismBackbone(
        num_frames=2, patch_size=4, hidden_dim=8, intermediate_dim=16,
        num_heads=2, num_spatial_layers=1, num_temporal_layers=1,
        num_auxiliary_layers=0, image_shape=(8, 8, 3)), inputs="spec"),
    # Scene-text recognition: a ViT encoder and a permuted-language decoder.
    "parseq": Family(lambda: models.PARSeqBackbone(
        image_encoder=models.ViTBackbone(
            image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
            hidden_dim=8, mlp_dim=16, use_class_token=False),
        vocabulary_size=VOCAB, max_label_length=5, decoder_hidden_dim=8,
        num_decoder_layers=1, num_decoder_heads=2, decoder_mlp_dim=16,
        dropout_rate=0.0, attention_dropout=0.0), inputs="spec"),
    # Monocular depth: a DINOv2 encoder, a DPT neck and head (no BN); two
    # encoder layers and neck stages, one reassembled up (a transposed
    # convolution), one down (a strided convolution), then fused.
    "depth_anything": Family(lambda: models.DepthAnythingBackbone(
        image_encoder=models.DINOV2Backbone(
            patch_size=4, num_layers=2, hidden_dim=8, num_heads=2,
            intermediate_dim=16, image_shape=(32, 32, 3),
            position_embedding_shape=(32, 32)),
        reassemble_factors=[2, 0.5], neck_hidden_dims=[4, 4],
        fusion_hidden_dim=4, head_hidden_dim=4, head_in_index=-1,
        feature_keys=["stage1", "stage2"]),
                           inputs="image"),
})
def _sam_prompts(backbone: keras.Model, rng):
  """Images and SAM prompts in pixel coordinates: two points (one
  foreground, one background or padding, label -1) and one box per
  example, no mask prompt (`masks` with 0 masks, as SAMImageSegmenter's
  placeholder)."""
  size = backbone.image_encoder.input.shape[1]
  labels = np.array([[1, 0], [1, -1], [0, 1], [1, 1]], "float32")[:B]
  corners = np.sort(rng.uniform(0, size, (B, 1, 2, 2)), axis=2)
  return {"images": rng.standard_normal((B, size, size, 3)).astype(
              "float32"),
          "points": rng.uniform(0, size, (B, 2, 2)).astype("float32"),
          "labels": labels,
          "boxes": corners.astype("float32"),
          "masks": np.zeros((B, 0, size, size, 1), "float32")}


def _sam_masks(backbone: keras.Model):
  """SAM's outputs as `SAMImageSegmenter` computes them (its mask decoder
  over the backbone's image and prompt embeddings): the masks `[B, k, H,
  W]` as a channels-last map, the IoU predictions `[B, k]` as the pooled
  output."""
  out = backbone.mask_decoder(**backbone(backbone.input))
  return {"sequence_output": keras.ops.transpose(out["masks"], (0, 2, 3, 1)),
          "pooled_output": out["iou_pred"]}


# Segment Anything (ViTDet image encoder, prompt encoder, two-way mask
# decoder), BLIP-2 (ViT, Q-Former, OPT) and Stable Diffusion 3's MMDiT
# (the network SD3 trains; `StableDiffusion3Backbone.diffuser` of a preset,
# here one block, the last, with SD3.5's q/k RMS norm and dual attention).
# SAM 3 is not here: in keras-hub 0.32 its forward pass fails in plain
# Keras for B = 4 (the geometry encoder's `[B, boxes + 1]` attention mask
# is not expanded to the heads; without boxes, the DETR encoder's prompt
# mask is shorter than its keys). SAM's and
# MMDiT's attention projections are not named as `enable_lora`'s defaults
# (`query`, `value`, ...): SAM's are unnamed Dense layers, so it has no
# LoRA target; MMDiT's LoRA targets its `attention_qkv`/`attention_proj`.
MORE_FAMILIES.update({
    "sam": Family(lambda: models.SAMBackbone(
        image_encoder=models.ViTDetBackbone(
            hidden_size=8, num_layers=1, intermediate_dim=16, num_heads=2,
            global_attention_layer_indices=[0], image_shape=(16, 16, 3),
            patch_size=4, num_output_channels=8, window_size=2),
        prompt_encoder=keras_hub.layers.SAMPromptEncoder(
            hidden_size=8, image_embedding_size=(4, 4),
            input_image_size=(16, 16), mask_in_channels=4),
        mask_decoder=keras_hub.layers.SAMMaskDecoder(
            num_layers=1, hidden_size=8, intermediate_dim=16, num_heads=2,
            embedding_dim=8, num_multimask_outputs=1, iou_head_depth=2,
            iou_head_hidden_dim=8)),
                  inputs=_sam_prompts, outputs=_sam_masks),
    "blip2": Family(lambda: models.BLIP2Backbone(
        vision_encoder=models.BLIP2VisionEncoder(
            image_size=8, patch_size=4, num_layers=1, num_heads=2,
            hidden_dim=8, intermediate_dim=16, use_patch_bias=True,
            use_class_token=True, use_mha_bias=True, use_mlp_bias=True,
            dropout_rate=0.0, layer_norm_epsilon=1e-6,
            initializer_range=0.02),
        qformer=models.BLIP2QFormer(
            num_query_tokens=2, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, vision_dim=8, cross_attention_frequency=1,
            dropout=0.0, layer_norm_epsilon=1e-6),
        language_model=models.BLIP2CustomOPT(
            vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, num_query_tokens=2, dropout=0.0,
            max_sequence_length=16, qformer_hidden_dim=8)), inputs="spec"),
    "sd3_mmdit": Family(lambda: MMDiT(
        patch_size=2, hidden_dim=8, num_layers=1, num_heads=2,
        position_size=4, latent_shape=(4, 4, 4), context_shape=(None, 8),
        pooled_projection_shape=(8,), qk_norm="rms_norm",
        dual_attention_indices=(0,)), inputs="spec",
                        lora_targets=("attention_qkv", "attention_proj")),
})
FAMILIES.update(MORE_FAMILIES)
TRAINABLE = sorted(set(FAMILIES) - {"resnet"} - set(MORE_FAMILIES))


def _checked(name: str, mode: str, check: Callable[[], Any]):
  """`check()`, its failure message prefixed with the family and the mode
  (full fine-tuning or LoRA) that failed."""
  try:
    return check()
  except AssertionError as e:
    raise AssertionError(f"{name}, {mode}: {e}") from e


# Families whose forward pass has the matmul pattern TF's oneDNN kernel
# computes wrongly (SAM's prompt encoder: boxes [B, 1, 2, 2] @ [2, F]):
# exact where oneDNN is off, refused naming the defect where it is on.
ONEDNN_DEFECTIVE = ("sam",)


# Families whose backbone has no layer `enable_lora` can target by name:
# SAM's, MiT's and ViTDet's attention projections are unnamed Dense layers
# (`dense_3`: Keras' per-process counter names them); VGG is convolutions.
NO_LORA_TARGET = ("mit", "sam", "vgg", "vitdet")


# The forms of LoRA layer `enable_lora` makes (the layer's class and, for
# an EinsumDense, its equation with the letters renamed in order of first
# appearance: `tf_pxg.rules.contraction` parses equations, the letters
# are names), each with a family of TRAINABLE whose LoRA step is checked
# and which has a layer of that form (asserted in `check_full_then_lora`):
# the query/value projection `[B, T, D] x [D, N, H]` (BERT; Llama's
# `bqm,muh->bquh` is the same form), Gemma's `[B, T, D] x [N, D, H]`, and
# a Dense projection (RWKV-7's `value`).
LORA_FORMS = {
    ("EinsumDense", "abc,cde->abde"): "bert",
    ("EinsumDense", "abc,dce->abde"): "gemma",
    ("Dense", None): "rwkv7",
}
# The slow families whose LoRA step is checked too: those whose LoRA
# targets are their own layer names (`Family.lora_targets`: Dense
# `q_proj`/`v_proj` and `q_dense_layer`/`v_dense_layer`, GPT-NeoX's fused
# `query_key_value`, MMDiT's `attention_qkv`/`attention_proj`). The other
# slow families' LoRA layers are KerasHub's default `query`/`value`
# projections, each of a form of LORA_FORMS (checked for each), whose LoRA
# step would add no code path (the module docstring says why).
MORE_LORA = tuple(sorted(n for n, f in MORE_FAMILIES.items()
                         if f.lora_targets is not None))


def lora_forms(backbone: keras.Model) -> set:
  """The forms (see LORA_FORMS) of `backbone`'s LoRA-enabled layers."""
  forms = set()
  for layer in _compat.flatten_layers(backbone):
    if getattr(layer, "lora_enabled", False):
      eq, letters = getattr(layer, "equation", None), {}
      if eq is not None:
        eq = "".join(letters.setdefault(c, chr(ord("a") + len(letters)))
                     if c.isalpha() else c for c in eq)
      forms.add((type(layer).__name__, eq))
  return forms


def check_full_then_lora(name: str) -> None:
  """The DP step checked exactly in full fine-tuning, then in LoRA on the
  same backbone: one build (seeded as `build`), the full step checked, then
  `enable_lora` (base weights frozen, `lora_kernel_b` randomised as in
  `build`) on the built weights (restored after the full step) and the
  LoRA step checked. Each mode has its own reference, `make_private` and
  traced step; a failure names the family and the mode. The families of
  NO_LORA_TARGET are left out of LoRA only because `enable_lora` finds no
  layer of its default names in them: that is checked instead. The slow
  families outside MORE_LORA get `enable_lora` and a check that it made
  LoRA layers, all of forms whose LoRA step LORA_FORMS's families check
  (see MORE_LORA), instead of their own LoRA step."""
  model, backbone, x, y = _build(name)
  initial = [v.numpy() for v in model.weights]
  if name in ONEDNN_DEFECTIVE and _compat.onednn_enabled():
    # TF's oneDNN batch matmul computes this family's box encoding wrongly
    # and corrupts the heap (tf_pxg.tape.tf_defects): refused by name.
    with pytest.raises(ValueError, match=r"BatchMatMulV2.*"
                       r"TF_ENABLE_ONEDNN_OPTS=0"):
      dp_step_error(model, x, y)
  else:
    _ERRORS[f"{name}-full"] = _checked(
        name, "full fine-tuning", lambda: dp_step_error(model, x, y))
  # LoRA from the built weights (as `build(name, lora=True)`), not from
  # those the full step (SGD(1)) left.
  for v, value in zip(model.weights, initial):
    v.assign(value)
  backbone.enable_lora(2, FAMILIES[name].lora_targets)
  _randomize_lora(model, np.random.default_rng(1))
  if name in NO_LORA_TARGET:
    assert not any("lora_kernel" in v.path for v in model.weights), name
    return
  forms = lora_forms(backbone)
  for form, family in LORA_FORMS.items():
    if family == name:
      assert form in forms, f"{name}: no LoRA layer of the form {form}"
  # LoRA weights that train (not only the head).
  assert any("lora_kernel_a" in v.path
             for v in model.trainable_variables), f"{name}: no LoRA weight"
  if name in MORE_FAMILIES:
    if name not in MORE_LORA:
      new = forms - set(LORA_FORMS)
      assert not new, (f"{name}: LoRA layers of the forms {sorted(new)} "
                       "are in no LoRA step checked: add the family to "
                       "MORE_LORA or to LORA_FORMS")
      return
  _ERRORS[f"{name}-lora"] = _checked(
      name, "LoRA", lambda: dp_step_error(model, x, y))


@pytest.mark.parametrize("name", TRAINABLE)
def test_dp_step_is_exact(name):
  """Full fine-tuning, then LoRA on the same backbone
  (`check_full_then_lora`)."""
  check_full_then_lora(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MORE_FAMILIES))
def test_more_families_dp_step_is_exact(name):
  """Every family of the table in full fine-tuning, then LoRA
  (`check_full_then_lora`): the LoRA step for MORE_LORA; for
  NO_LORA_TARGET, that there is no LoRA target; for the others, that
  their LoRA layers are of LORA_FORMS."""
  check_full_then_lora(name)


def _fit_error(model: keras.Model, x, y) -> str:
  """The message of the error a noiseless DP `fit` step raises."""
  dp = dpk.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
  dp.compile(optimizer=keras.optimizers.SGD(1.0),
             loss=keras.losses.SparseCategoricalCrossentropy(
                 from_logits=True))
  with pytest.raises(ValueError) as info:
    dp.fit(x, y, batch_size=B, epochs=1, verbose=0)
  return str(info.value)


def test_bert_segment_ids_made_inside_the_model_is_exact():
  """`ops.zeros_like(token_ids)` as BERT's segment ids inside the model:
  TF folds it into a constant `[B, T]`, whose equal rows make the segment
  embedding's rows a copy along the batch axis (`tf_pxg.interface.batch_copies`)."""
  keras.utils.set_random_seed(0)
  backbone = models.BertBackbone(**ENCODER)
  ids = keras.Input((T,), dtype="int32", name="token_ids")
  mask = keras.Input((T,), dtype="int32", name="padding_mask")
  out = backbone({"token_ids": ids, "padding_mask": mask,
                  "segment_ids": keras.ops.zeros_like(ids)})
  model = keras.Model({"token_ids": ids, "padding_mask": mask},
                      keras.layers.Dense(CLASSES)(out["pooled_output"]))
  x = _text(np.random.default_rng(0))
  _ERRORS["bert-full-zeros_like_segments"] = dp_step_error(
      model, x, np.arange(B) % CLASSES)


def test_xlnet_attention_mask_reshape_is_refused_by_name():
  """KerasHub's XLNet builds its attention mask with
  `ops.reshape(1 - padding_mask, [T, B])` (a reshape, not a transpose), so
  example b's mask holds other examples' padding: the examples mix, and
  the step is refused at trace time naming the op and its layer."""
  keras.utils.set_random_seed(0)
  backbone = models.XLNetBackbone(vocabulary_size=VOCAB, num_heads=2, **TEXT)
  model = classifier(backbone)
  msg = _fit_error(model, batch(backbone, "spec"), np.zeros(B))
  assert "'Reshape'" in msg and "attn_mask" in msg, msg
  assert "mixes examples" in msg, msg


def test_clip_contrastive_logits_are_refused():
  """CLIP's joint logits `z_image @ z_text^T` compare each example with
  the others of its batch (in-batch negatives): no per-example loss, so
  refused naming the MatMul; each tower trains alone (families above)."""
  keras.utils.set_random_seed(0)
  backbone = models.CLIPBackbone(
      FAMILIES["clip_vision"].build(), FAMILIES["clip_text"].build(),
      projection_dim=8)
  model = keras.Model(backbone.input,
                      backbone(backbone.input)["vision_logits"])
  msg = _fit_error(model, batch(backbone, "spec"), np.arange(B))
  assert "'MatMul'" in msg and "clip_head" in msg, msg
  assert "in-batch negatives" in msg, msg


def test_mixture_of_experts_aux_loss_is_refused_by_name():
  """Mixtral's router adds a batch-level auxiliary loss (`add_loss`): it
  has no per-example split, so DP training refuses it, naming the layer
  (with the coefficient 0 it trains exactly: `mixtral` above)."""
  keras.utils.set_random_seed(0)
  backbone = models.MixtralBackbone(**DECODER, num_experts=2)
  model, x = classifier(backbone), batch(backbone, "text")
  dp = dpk.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
  dp.compile(optimizer=keras.optimizers.SGD(1.0),
             loss=keras.losses.SparseCategoricalCrossentropy(
                 from_logits=True))
  with pytest.raises(ValueError, match="add_loss") as info:
    dp.fit(x, np.zeros(B), batch_size=B, epochs=1, verbose=0)
  assert "sparse_moe_block" in str(info.value), info.value
  assert "router_aux_loss_coefficient=0" in str(info.value), info.value


@pytest.mark.parametrize("name,mode", [
    ("gpt2", "xla"), ("llama", "xla"), ("vit", "xla"), ("bert", "xla"),
    ("gpt2", "eager"), ("deberta_v3", "eager")])
def test_dp_step_is_exact_under_xla_and_eagerly(name, mode):
  """The same step with `jit_compile=True` (Keras' XLA-compiled step) or
  `run_eagerly=True`."""
  model, x, y = build(name, lora=False)
  _ERRORS[f"{name}-full-{mode}"] = dp_step_error(
      model, x, y, jit_compile=mode == "xla", run_eagerly=mode == "eager")


def causal_lm(name: str, lora: bool):
  """(model, inputs, next-token labels, padding mask): the backbone's
  sequence output through its own (tied) token embedding, reversed."""
  keras.utils.set_random_seed(0)
  backbone = FAMILIES[name].build()
  logits = backbone.token_embedding(backbone(backbone.input), reverse=True)
  model = keras.Model(backbone.input, logits)
  if lora:
    backbone.enable_lora(2)
    _randomize_lora(model, np.random.default_rng(1))
  x = batch(backbone, "text")
  ids, mask = x["token_ids"], x["padding_mask"]
  labels = np.concatenate([ids[:, 1:], np.zeros((B, 1), "int32")], 1)
  weights = np.concatenate([mask[:, 1:], np.zeros((B, 1), "int32")], 1)
  return model, x, labels, weights.astype("float32")


@pytest.mark.parametrize("name,lora", [("gpt2", False), ("gpt2", True),
                                       ("llama", False), ("gemma", True)])
def test_causal_lm_dp_step_is_exact(name, lora):
  """Next-token loss, each example the mean over its positions with the
  padding masked (KerasHub's CausalLM passes the mask as sample_weight)."""
  model, x, y, w = causal_lm(name, lora)
  _ERRORS[f"{name}-{'lora' if lora else 'full'}-causal_lm"] = dp_step_error(
      model, x, y, sample_weight=w)


@pytest.mark.parametrize("name,lora", [("bert", False), ("gpt2", True)])
def test_noisy_poisson_fit_trains(name, lora):
  """`fit` with noise on Poisson batches (the default DP data path) runs
  and moves the weights to finite values, and ε is accounted; in full
  fine-tuning and in LoRA. What it adds to the exact steps (which run on
  Poisson batches of rate 1) is family-independent: the noise drawn for
  each trained weight, steps whose batch size varies (rate 1/2 here) and
  the accountant; each family's per-example gradients and clipping are
  the exact checks' (`check_full_then_lora`)."""
  model, x, y = build(name, lora)
  x = tf.nest.map_structure(lambda a: np.concatenate([a, a]), x)
  y = np.concatenate([y, y])
  dp = dpk.make_private(model, l2_norm_clip=1.0, noise_multiplier=1.0,
                        seed=0)
  dp.compile(optimizer=keras.optimizers.SGD(0.1),
             loss=keras.losses.SparseCategoricalCrossentropy(
                 from_logits=True))
  before = [v.numpy() for v in dp.trainable_variables]
  privacy = dpk.PrivacyCallback(num_examples=len(y), batch_size=B,
                                delta=1e-5)
  dp.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[privacy])
  after = [v.numpy() for v in dp.trainable_variables]
  assert all(np.isfinite(a).all() for a in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))
  assert 0 < privacy.epsilon() < np.inf


@pytest.mark.parametrize("policy,rtol", [("mixed_bfloat16", 2e-2),
                                         ("mixed_float16", 5e-3)])
def test_mixed_precision_dp_step_matches_float32(policy, rtol):
  """A GPT-2 classifier built under a mixed policy (float16/bfloat16
  compute, float32 weights) takes the float32 model's noiseless DP step
  within the precision: `rtol` of each variable's update, plus float noise
  at 1e-3 of the largest update (for weights whose exact gradient is 0,
  e.g. the attention key bias). The model is compiled under float32, so
  mixed_float16 runs without a LossScaleOptimizer here (with one:
  tests/test_mixed_precision.py)."""
  def build_in(dtype_policy):
    keras.config.set_dtype_policy(dtype_policy)
    try:
      keras.utils.set_random_seed(0)
      backbone = FAMILIES["gpt2"].build()
      return classifier(backbone), backbone
    finally:
      keras.config.set_dtype_policy("float32")

  model, backbone = build_in("float32")
  mixed, _ = build_in(policy)
  mixed.set_weights(model.get_weights())
  x = batch(backbone, "text")
  y = np.random.default_rng(2).integers(0, CLASSES, size=(B,))
  ref = pxg_testing.reference_per_example_gradients(
      keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                 reduction=None),
      model, model.trainable_variables,
      tf.nest.map_structure(tf.constant, x), tf.constant(y))
  clip = float(np.median(pxg_testing.per_example_global_norms(ref)))
  dp = dpk.make_private(mixed, l2_norm_clip=clip, noise_multiplier=0.0)
  dp.compile(optimizer=keras.optimizers.SGD(1.0),
             loss=keras.losses.SparseCategoricalCrossentropy(
                 from_logits=True))
  before = [v.numpy() for v in dp.trainable_variables]
  dp.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False)
  expected = pxg_testing.expected_dp_sgd_weights(before, ref, clip)
  largest = max(float(np.max(np.abs(e - b)))
                for e, b in zip(expected, before))
  err = pxg_testing.assert_dp_step_matches_reference(
      dp.trainable_variables, before, expected, rtol=rtol,
      atol=1e-3 * largest, names=[v.path for v in dp.trainable_variables])
  _ERRORS[f"gpt2-full-{policy}"] = err * rtol


# D-FINE (a real-time DETR: HGNetV2 backbone, hybrid encoder, deformable
# decoder) normalises with BatchNormalization throughout: refused by name.
_D_FINE = dict(
    decoder_in_channels=[8, 8], encoder_hidden_dim=8, num_labels=CLASSES,
    num_denoising=0, learn_initial_query=False, num_queries=4,
    anchor_image_size=(32, 32), feat_strides=[4, 8], num_feature_levels=2,
    hidden_dim=8, encoder_in_channels=[8, 8], encode_proj_layers=[1],
    num_attention_heads=2, encoder_ffn_dim=16, num_encoder_layers=1,
    hidden_expansion=0.5, depth_multiplier=0.5, eval_idx=-1,
    num_decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=16,
    decoder_n_points=[2, 2], lqe_hidden_dim=4, num_lqe_layers=1,
    out_features=["stage1", "stage2"], image_shape=(32, 32, 3), seed=0)


def _d_fine() -> keras.Model:
  return models.DFineBackbone(backbone=models.HGNetV2Backbone(
      stem_channels=[3, 4, 4], embedding_size=4, hidden_sizes=[8, 8],
      stackwise_stage_filters=[[4, 4, 8, 1, 1, 3], [8, 4, 8, 1, 1, 3]],
      apply_downsample=[False, True], use_lightweight_conv_block=[False, True],
      depths=[1, 1], use_learnable_affine_block=True, hidden_act="relu",
      image_shape=(32, 32, 3), out_features=["stage1", "stage2"]),
                              **_D_FINE)


@pytest.mark.parametrize("build_model", [
    lambda: build("resnet", lora=False)[0], _d_fine], ids=["resnet", "d_fine"])
def test_batch_norm_full_fine_tuning_is_refused_by_name(build_model):
  """`make_private` names the first trainable BatchNormalization layer
  (ResNet's; D-FINE's, in its HGNetV2 backbone) and suggests a replacement."""
  keras.utils.set_random_seed(0)
  model = build_model()
  first = next(layer.name for layer in _compat.flatten_layers(model)
               if isinstance(layer, keras.layers.BatchNormalization))
  with pytest.raises(ValueError) as info:
    dpk.make_private(model, l2_norm_clip=1.0, noise_multiplier=0.0)
  msg = str(info.value)
  assert f"{first!r}" in msg and "BatchNormalization" in msg, msg
  assert "GroupNormalization" in msg or "LayerNormalization" in msg, msg


def test_resnet_frozen_backbone_head_is_exact():
  model, x, y = build("resnet", lora=True)  # enable_lora freezes it all.
  assert [v.path.split("/")[-1] for v in model.trainable_variables] == [
      "kernel", "bias"]
  _ERRORS["resnet-lora"] = dp_step_error(model, x, y)


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
  """Prints (pytest -s) each family's error relative to its update."""
  yield
  for k in sorted(_ERRORS):
    print(f"[keras_hub] {k}: {_ERRORS[k]:.2g} of the update")
