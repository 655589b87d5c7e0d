"""Load GGUF files (llama.cpp's format) into mlx-lm model classes.

Architectures: ``llama`` -> ``mlx_lm.models.llama``; ``gemma3`` -> ``mlx_lm.models.gemma3_text``.

Tensor names, GGUF -> HF / mlx-lm (``N`` is the layer):
    token_embd -> model.embed_tokens     output_norm -> model.norm     output -> lm_head (absent: tied)
    blk.N.attn_norm -> model.layers.N.input_layernorm
    blk.N.attn_{q,k,v} -> self_attn.{q,k,v}_proj          blk.N.attn_output -> self_attn.o_proj
    blk.N.ffn_{gate,up,down} -> mlp.{gate,up,down}_proj
    blk.N.ffn_norm -> post_attention_layernorm (llama), pre_feedforward_layernorm (gemma3)
    gemma3 only: post_attention_norm -> post_attention_layernorm, post_ffw_norm -> post_feedforward_layernorm,
                 attn_{q,k}_norm -> self_attn.{q,k}_norm
    blk.N.nextn.* (MTP layers, GLM / DeepSeek): see ``read_gguf_mtp_tensors``.

Value changes:
    llama: llama.cpp permutes the rows of Q and K (for its interleaved RoPE); undone here for mlx-lm's rotate-half RoPE.
    gemma3: llama.cpp stores every RMSNorm weight as 1 + w while mlx-lm computes x * (1 + w): 1 is subtracted.
    llama 3.x: the ``rope_freqs`` tensor (per-dimension frequency factors) becomes HF's "llama3" rope_scaling when
        Meta's defaults reproduce it, else a FactorRoPE on every layer (which the config cannot express).

Tensor types:
    F32, F16 as stored; BF16 -> bfloat16.
    Q4_0, Q4_1, Q8_0 -> MLX affine quantization with group size 32 (weight uint32, scales, biases, all exact):
        Q4_0 bias = -8 d, Q8_0 bias = -128 d, Q4_1 bias = m.
    Everything else (K-quants Q2_K..Q6_K, Q5_0, Q5_1, IQ*) -> ``gguf.quants.dequantize`` -> float16.
    With ``dtype`` every tensor is dequantized and cast to ``dtype`` (the CPU path uses float32).

``mx.load`` decodes F32, F16, Q4_0, Q4_1 and Q8_0 correctly and is used when a file holds only those types.
Otherwise the tensors are decoded here with numpy: mx.load turns BF16 into float16 (large values overflow),
decodes Q4_K wrongly without an error, and fails on the whole file when it meets Q3_K, Q5_K, Q5_0 or Q5_1.
The header is parsed here too: ``gguf.GGUFReader`` needs ~16 s for a 262k-token vocabulary.

Modules: file.py (the container), tensors.py (tensor types -> MLX), architectures.py (names and configs per
architecture), model.py (load_gguf, the MTP layers), tokenizer.py (the tokenizer in the metadata).
"""

from .file import GGUFFile, GGUFTensor, read_gguf  # noqa: F401
from .tensors import QArray, load_tensors  # noqa: F401
from .architectures import hf_name  # noqa: F401
from .model import load_gguf, read_gguf_mtp_tensors  # noqa: F401
from .tokenizer import gguf_tokenizer  # noqa: F401
