"""One config for every Transformer attnmask builds: :class:`ModelConfig`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from attnmask.errors import UserError

ARCHS = ("encoder_decoder", "decoder")
POSITIONS = ("sinusoidal", "learned", "rotary")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu_tanh")
GATED_ACTIVATIONS = ("swiglu", "geglu_tanh")  # down(act(gate(x)) * up(x))


@dataclass
class ModelConfig:
    """Hyper-parameters of an attnmask Transformer.

    Fields left as None take their defaults in ``__post_init__`` (``n_kv_heads = n_heads``,
    ``head_dim = dim // n_heads``, ``ffn_dim = 4 * dim``, ``n_encoder_layers = n_layers`` for an
    encoder-decoder, 0 for a decoder), so every later reader sees one spelling of each value.
    """

    vocab_size: int  # target (or only) vocabulary, V
    arch: str = "decoder"  # "encoder_decoder" or "decoder"
    src_vocab_size: int | None = None  # encoder vocabulary; None = shared with the decoder
    dim: int = 256  # model width C
    n_layers: int = 4  # decoder layers
    n_encoder_layers: int | None = None  # encoder layers; None = n_layers
    n_heads: int = 4  # query heads H
    n_kv_heads: int | None = None  # key/value heads Hkv (grouped-query when < n_heads); None = n_heads
    head_dim: int | None = None  # None = dim // n_heads
    ffn_dim: int | None = None  # None = 4 * dim
    max_seq_len: int = 512  # longest sequence for learned/sinusoidal positions and decoding
    positions: str = "sinusoidal"  # "sinusoidal" | "learned" | "rotary"
    rope_theta: float = 10000.0  # rotary base
    # rotary frequency scaling of long-context checkpoints: None, {"rope_type": "linear", "factor": f}
    # or Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (Hugging Face's names)
    rope_scaling: dict | None = None
    # rotary base of the sliding-window layers (Gemma 3: 10,000 there, rope_theta = 1,000,000 on the
    # full layers; rope_scaling applies to the full layers only); None = rope_theta on every layer
    rope_local_theta: float | None = None
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    norm_position: str = "pre"  # "pre" (GPT-2/Llama) or "post" (original Transformer, Marian)
    final_norm: bool = True  # a norm after the last layer (pre-norm models)
    # "relu" | "gelu" | "gelu_tanh" | "silu", or gated: "swiglu" (silu(gate) * up, Llama) |
    # "geglu_tanh" (tanh-approximated gelu(gate) * up, Gemma)
    activation: str = "gelu"
    bias: bool = True  # biases in linear layers
    dropout: float = 0.0
    tie_embeddings: bool = True  # lm_head shares the (target) embedding matrix
    embed_scale: bool = False  # multiply embeddings by sqrt(dim) (original Transformer, Marian, Gemma)
    qk_norm: bool = False  # an RMSNorm over head_dim on each head of q and k, before RoPE (Gemma 3)
    # a norm on each sublayer's output before the residual add, besides the pre-norm (Gemma 2/3:
    # x + post_norm(attn(pre_norm(x)))); pre-norm models only
    post_norms: bool = False
    lm_head_bias: bool = False  # a bias on the logits (Marian's final_logits_bias)
    pad_id: int | None = 0  # None: no padding id (pretrained LMs whose every id is a real token)
    attn_backend: str = "auto"
    # self-attention reach per layer: 0 = every earlier position; w > 0 = the last w positions
    # (``causal() & sliding_window(w)``) on the layers whose ``layer_types`` entry is "sliding"
    # (None: every layer, when sliding_window > 0). Gemma 3: w = 512 on five layers of six.
    sliding_window: int = 0
    layer_types: tuple[str, ...] | None = None  # per decoder layer: "sliding" | "full"
    extra: dict = field(default_factory=dict)  # free-form notes (e.g. where weights came from)

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.n_heads > 0 and self.dim % self.n_heads != 0:
                raise UserError(f"dim={self.dim} must be divisible by n_heads={self.n_heads} (or set head_dim)")
            self.head_dim = self.dim // max(self.n_heads, 1)
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim
        if self.n_encoder_layers is None:
            self.n_encoder_layers = self.n_layers if self.arch == "encoder_decoder" else 0
        for name, val, allowed in (
            ("arch", self.arch, ARCHS),
            ("positions", self.positions, POSITIONS),
            ("norm", self.norm, NORMS),
            ("norm_position", self.norm_position, NORM_POSITIONS),
            ("activation", self.activation, ACTIVATIONS),
        ):
            if val not in allowed:
                raise UserError(f"ModelConfig.{name}={val!r}, expected one of {allowed}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise UserError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.arch == "encoder_decoder" and self.n_encoder_layers < 1:
            raise UserError(
                f"ModelConfig.n_encoder_layers must be >= 1 for an encoder-decoder, got {self.n_encoder_layers}"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise UserError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.positions == "rotary" and self.head_dim % 2:
            raise UserError(f"rotary positions need an even head dim, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.post_norms and self.norm_position != "pre":
            raise UserError("post_norms (a norm on each sublayer's output) needs norm_position='pre'")
        if self.rope_local_theta is not None and self.rope_local_theta <= 0:
            raise UserError(f"rope_local_theta must be > 0 (or None), got {self.rope_local_theta}")
        if self.sliding_window < 0:
            raise UserError(f"sliding_window must be >= 0 (0: none), got {self.sliding_window}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad or len(self.layer_types) != self.n_layers:
                raise UserError(
                    f"layer_types must name each of the {self.n_layers} layers as one of {LAYER_TYPES}; "
                    f"got {list(self.layer_types)}"
                )

    def layer_window(self, layer: int) -> int:
        """The self-attention window of decoder layer ``layer``: 0 = full causal, w = the last w keys."""
        if self.sliding_window == 0:
            return 0
        if self.layer_types is None or self.layer_types[layer] == "sliding":
            return self.sliding_window
        return 0

    def layer_rope_theta(self, layer: int) -> float:
        """The rotary base of decoder layer ``layer``: ``rope_local_theta`` on sliding layers when set."""
        if self.rope_local_theta is not None and self.layer_window(layer) > 0:
            return self.rope_local_theta
        return self.rope_theta

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise UserError(f"unknown ModelConfig fields {sorted(unknown)}; expected some of {sorted(known)}")
        return cls(**d)


LAYER_TYPES = ("sliding", "full")

ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rope_scaling(scaling: dict) -> None:
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise UserError(f"rope_scaling rope_type={kind!r}, expected one of {sorted(ROPE_SCALING_KEYS)}")
    missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in scaling]
    if missing:
        raise UserError(f"rope_scaling of type {kind!r} lacks {missing}; got {scaling}")
