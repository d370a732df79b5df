"""A table of well-known models: per-layer forward FLOPs and parameter bytes.

FLOPs count a multiply-add as 2; backward is taken as 2x forward (weight and input
gradients). Shapes follow the published architectures; Inception-V3 is given per block with
block totals estimated from its layer shapes (23.8 M parameters, ~5.7 GMAC per image, like
torchvision's model without the auxiliary head). :func:`model_workload` turns a model into
a :class:`~scaleout.sim.workload.Workload` for a device of a given sustained rate.

Example:
    >>> spec = model("resnet50")
    >>> round(spec.params / 1e6, 1), round(spec.flops / 2e9, 2)   # M params, GMAC
    (25.6, 4.09)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from scaleout.sim.workload import Layer, Workload, finite_number

__all__ = ["ModelLayer", "ModelSpec", "Device", "DEVICES", "MODELS", "model", "model_workload"]


@dataclass(frozen=True)
class ModelLayer:
    """Forward FLOPs per sample and parameter count of one layer."""

    name: str
    flops: float
    params: int


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model: its layers in forward order and where its shapes come from."""

    name: str
    layers: tuple[ModelLayer, ...]
    source: str

    @property
    def params(self) -> int:
        """Parameters in all."""
        return sum(layer.params for layer in self.layers)

    @property
    def flops(self) -> float:
        """Forward FLOPs per sample in all."""
        return sum(layer.flops for layer in self.layers)


@dataclass(frozen=True, kw_only=True)
class Device:
    """A device's sustained training rate (FLOP/s actually reached, not peak) and its source."""

    name: str
    flops: float
    source: str

    def __post_init__(self) -> None:
        if not finite_number(self.flops, positive=True):
            raise ValueError(f"Device.flops must be a finite number > 0, got {self.flops!r}")


def _conv(name: str, cin: int, cout: int, k: int, hw: int) -> ModelLayer:
    """A convolution (+ its batch norm) producing an ``hw`` x ``hw`` map."""
    return ModelLayer(name, 2.0 * k * k * cin * cout * hw * hw, k * k * cin * cout + 2 * cout)


def _fc(name: str, cin: int, cout: int, tokens: int = 1) -> ModelLayer:
    return ModelLayer(name, 2.0 * cin * cout * tokens, cin * cout + cout)


def _resnet(
    blocks: tuple[int, ...], bottleneck: bool, classes: int = 1000
) -> tuple[ModelLayer, ...]:
    layers = [_conv("conv1", 3, 64, 7, 112)]
    cin, expansion = 64, 4 if bottleneck else 1
    for stage, (count, width, hw) in enumerate(zip(blocks, (64, 128, 256, 512), (56, 28, 14, 7))):
        for block in range(count):
            tag = f"layer{stage + 1}.{block}"
            cout = width * expansion
            if bottleneck:
                in_hw = hw * 2 if block == 0 and stage > 0 else hw  # v1.5: stride in conv2
                layers += [
                    _conv(f"{tag}.conv1", cin, width, 1, in_hw),
                    _conv(f"{tag}.conv2", width, width, 3, hw),
                    _conv(f"{tag}.conv3", width, cout, 1, hw),
                ]
            else:
                layers += [
                    _conv(f"{tag}.conv1", cin, width, 3, hw),
                    _conv(f"{tag}.conv2", width, width, 3, hw),
                ]
            if block == 0 and cin != cout:
                layers.append(_conv(f"{tag}.downsample", cin, cout, 1, hw))
            cin = cout
    layers.append(_fc("fc", cin, classes))
    return tuple(layers)


def _vgg16() -> tuple[ModelLayer, ...]:
    layers, cin, hw, n = [], 3, 224, 0
    for item in (
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        "M",
    ):
        if item == "M":
            hw //= 2
            continue
        n += 1
        layers.append(ModelLayer(f"conv{n}", 2.0 * 9 * cin * item * hw * hw, 9 * cin * item + item))
        cin = item
    return tuple(layers) + (
        _fc("fc6", 512 * 7 * 7, 4096),
        _fc("fc7", 4096, 4096),
        _fc("fc8", 4096, 1000),
    )


def _inception_v3() -> tuple[ModelLayer, ...]:
    # (block, parameters, multiply-adds): estimated per block from the layer shapes.
    blocks = (
        ("stem", 170_000, 1.34e9),
        ("mixed_5b", 256_000, 0.31e9),
        ("mixed_5c", 277_000, 0.34e9),
        ("mixed_5d", 288_000, 0.35e9),
        ("mixed_6a", 1_153_000, 0.36e9),
        ("mixed_6b", 1_298_000, 0.38e9),
        ("mixed_6c", 1_692_000, 0.49e9),
        ("mixed_6d", 1_692_000, 0.49e9),
        ("mixed_6e", 2_143_000, 0.62e9),
        ("mixed_7a", 1_699_000, 0.20e9),
        ("mixed_7b", 5_045_000, 0.32e9),
        ("mixed_7c", 6_076_000, 0.39e9),
        ("fc", 2_049_000, 2.0e6),
    )
    return tuple(ModelLayer(name, 2.0 * macs, params) for name, params, macs in blocks)


def _transformer(
    n_layers: int, hidden: int, seq: int, vocab: int, prefix: str
) -> tuple[ModelLayer, ...]:
    attention = 2.0 * 2 * seq * seq * hidden  # QK^T and AV per sample
    layers = [ModelLayer(f"{prefix}.embeddings", 0.0, vocab * hidden + seq * hidden + 2 * hidden)]
    for i in range(n_layers):
        layers.append(
            ModelLayer(
                f"{prefix}.layer{i}.attention",
                2.0 * seq * 4 * hidden * hidden + attention,
                4 * hidden * hidden + 6 * hidden,
            )
        )
        layers.append(
            ModelLayer(
                f"{prefix}.layer{i}.mlp",
                2.0 * seq * 8 * hidden * hidden,
                8 * hidden * hidden + 7 * hidden,
            )
        )
    # the head's weight is tied to the embedding: its FLOPs here, its gradient with the embedding
    layers.append(
        ModelLayer(
            f"{prefix}.head",
            2.0 * seq * (hidden * hidden + vocab * hidden),
            hidden * hidden + 3 * hidden,
        )
    )
    return tuple(layers)


def _dlrm() -> tuple[ModelLayer, ...]:
    bottom = (13, 512, 256, 128)
    top = (128 + 27 * 26 // 2, 1024, 1024, 512, 256, 1)
    layers = [ModelLayer(f"embedding{t}", 0.0, 100_000 * 128) for t in range(8)]
    layers += [_fc(f"bottom{i}", a, b) for i, (a, b) in enumerate(zip(bottom, bottom[1:]))]
    layers += [_fc(f"top{i}", a, b) for i, (a, b) in enumerate(zip(top, top[1:]))]
    return tuple(layers)


def _gpt(n_layers: int = 96, hidden: int = 1024, seq: int = 1024, vocab: int = 50257) -> ModelSpec:
    return ModelSpec(
        name=f"gpt-{n_layers}",
        source=f"GPT-2 layout, {n_layers} layers, d={hidden}, seq {seq}, vocab {vocab}",
        layers=_transformer(n_layers, hidden, seq, vocab, "gpt"),
    )


_TABLE: Mapping[str, Callable[[], ModelSpec]] = MappingProxyType(
    {
        "resnet18": lambda: ModelSpec(
            name="resnet18",
            source="He et al. 2016, 224x224, 1000 classes",
            layers=_resnet((2, 2, 2, 2), False),
        ),
        "resnet50": lambda: ModelSpec(
            name="resnet50",
            source="He et al. 2016 (v1.5), 224x224",
            layers=_resnet((3, 4, 6, 3), True),
        ),
        "resnet101": lambda: ModelSpec(
            name="resnet101",
            source="He et al. 2016 (v1.5), 224x224",
            layers=_resnet((3, 4, 23, 3), True),
        ),
        "resnet152": lambda: ModelSpec(
            name="resnet152",
            source="He et al. 2016 (v1.5), 224x224",
            layers=_resnet((3, 8, 36, 3), True),
        ),
        "vgg16": lambda: ModelSpec(
            name="vgg16", source="Simonyan & Zisserman 2015, 224x224", layers=_vgg16()
        ),
        "inception_v3": lambda: ModelSpec(
            name="inception_v3",
            source="Szegedy et al. 2016, 299x299; per-block estimate",
            layers=_inception_v3(),
        ),
        "bert_large": lambda: ModelSpec(
            name="bert_large",
            source="Devlin et al. 2019: 24 layers, d=1024, seq 128, vocab 30522",
            layers=_transformer(24, 1024, 128, 30522, "bert"),
        ),
        "gpt": _gpt,
        "dlrm": lambda: ModelSpec(
            name="dlrm",
            source="MLPerf DLRM MLPs (13-512-256-128, "
            "479-1024-1024-512-256-1), 8 tables of 100k x 128 (dense gradients)",
            layers=_dlrm(),
        ),
    }
)
MODELS = tuple(_TABLE)

DEVICES: Mapping[str, Device] = MappingProxyType(
    {
        d.name: d
        for d in (
            Device(
                name="p100",
                flops=5.4e12,
                source="P100 fp32: ~219 img/s on ResNet-50 in "
                "tf_cnn_benchmarks x 3 x 8.2 GFLOP = 5.4 TFLOP/s (58% of its 9.3 peak)",
            ),
            Device(
                name="v100",
                flops=12.0e12,
                source="V100 fp32 ~ 15.7 TFLOP/s peak, 75% sustained assumed",
            ),
            Device(
                name="a100",
                flops=60.0e12,
                source="A100 tf32/bf16 mixed, ~20% of 312 TFLOP/s peak assumed",
            ),
            Device(
                name="h100", flops=200.0e12, source="H100 bf16, ~20% of 989 TFLOP/s peak assumed"
            ),
            Device(
                name="xeon-phi-7250",
                flops=1.9e12,
                source="Xeon Phi 7250: 6.1 TFLOP/s fp32 peak; "
                "Intel Caffe ResNet-50 ~ 30% of it assumed",
            ),
            Device(
                name="xeon-8160x2",
                flops=1.9e12,
                source="2 x Xeon 8160: 6.4 TFLOP/s fp32 peak, 30% assumed",
            ),
        )
    }
)


def model(name: str) -> ModelSpec:
    """The table's model ``name``; ``gpt:LAYERS[:HIDDEN[:SEQ[:VOCAB]]]`` (96:1024:1024:50257).

    Raises:
        ValueError: an unknown model or malformed ``gpt`` spec.
    """
    head, _, rest = name.partition(":")
    if head == "gpt" and rest:
        try:
            args = [int(x) for x in rest.split(":")]
        except ValueError:
            raise ValueError(
                f"gpt spec must be gpt:LAYERS[:HIDDEN[:SEQ[:VOCAB]]], got {name!r}"
            ) from None
        if len(args) > 4 or min(args) < 1:
            raise ValueError(
                f"gpt spec must be gpt:LAYERS[:HIDDEN[:SEQ[:VOCAB]]] (>= 1 each), got {name!r}"
            )
        return _gpt(*args)
    if head not in _TABLE or rest:
        raise ValueError(
            f"unknown model {name!r}; known: {', '.join(MODELS)} "
            "(gpt as gpt:LAYERS[:HIDDEN[:SEQ[:VOCAB]]])"
        )
    return _TABLE[head]()


def model_workload(
    name: str | ModelSpec, *, device: Device | float, batch_size: int, grad_bytes_per_param: int = 4
) -> Workload:
    """A workload: ``batch_size`` samples per rank of model ``name`` on ``device``.

    Args:
        name: a table name (or a :class:`ModelSpec`).
        device: a :class:`Device` or a sustained FLOP/s.
        batch_size: samples per rank per iteration.
        grad_bytes_per_param: 4 for fp32 gradients, 2 for fp16/bf16.

    Raises:
        ValueError: an unknown model, a rate or batch size out of range.
    """
    spec = model(name) if isinstance(name, str) else name
    rate = device.flops if isinstance(device, Device) else float(device)
    if not 0 < rate < math.inf:  # (nan too)
        raise ValueError(f"device rate must be a finite number > 0 FLOP/s, got {device!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return Workload(
        name=spec.name,
        batch_size=batch_size,
        layers=tuple(
            Layer(
                name=lay.name,
                forward_s=lay.flops * batch_size / rate,
                backward_s=2 * lay.flops * batch_size / rate,
                grad_bytes=lay.params * grad_bytes_per_param,
            )
            for lay in spec.layers
        ),
    )
