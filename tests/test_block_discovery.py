"""Blocks are found in models nobody here wrote, and layerwise saves on them: tiny in-repo replicas of the
structures of torchvision's ViT, DenseNet, RegNet, ConvNeXt and MaxViT, of a UNet and of a transformers Llama
(torchvision itself does not import with this torch build). For each, the ledger's device weight peak with
prefetch 1 is at most 60% of the model, outputs equal the plain model's and traffic equals the plan
(`assert_offload_equivalent`). A model that cannot be split is warned about before it runs, with the fix."""

import re
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_compiler import OffloadPolicy, OffloadSavingWarning, describe_plan, offload_compile, plan_summary
from offload_compiler.grouping import block_paths, plan_groups
from offload_compiler.testing import assert_offload_equivalent

POLICY = dict(strategy="layerwise", device="cpu", prefetch=1, compiler="eager", debug_poison=True)
MOST_OF_MODEL = 0.6  # issue 30's target: layerwise device weight peak at most 60% of the model (prefetch 1)


def conv_bn(cin: int, cout: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: an nn.Sequential of single layers."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class SelfAttention(nn.Module):
    """nn.MultiheadAttention's weights, with plain ops: its fused inference path rounds differently from the
    traced one (about 4e-7), and these tests compare bit for bit."""

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.in_proj(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5).softmax(-1)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, n, d))


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


# -- torchvision's VisionTransformer: encoder.layers is an nn.Sequential of encoder_layer_{i} -----------------

class EncoderBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = SelfAttention(dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.self_attention(h)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, dim: int, depth: int, tokens: int):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", EncoderBlock(dim)) for i in range(depth)))
        self.ln = nn.LayerNorm(dim)

    def forward(self, x):
        return self.ln(self.layers(x + self.pos_embedding))


class VisionTransformer(nn.Module):
    def __init__(self, dim=32, depth=6, patch=4, image=16, classes=10):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, dim, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = Encoder(dim, depth, (image // patch) ** 2 + 1)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, classes)))

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


# -- torchvision's DenseNet: features holds denseblock{i} (ModuleDicts of denselayer{j}) and transition{i} -----

class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(4 * growth), nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features):
        x = self.conv1(F.relu(self.norm1(torch.cat(features, 1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, cin: int, growth: int):
        super().__init__({f"denselayer{i + 1}": DenseLayer(cin + i * growth, growth) for i in range(layers)})

    def forward(self, x):
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(OrderedDict(norm=nn.BatchNorm2d(cin), relu=nn.ReLU(), conv=nn.Conv2d(cin, cout, 1, bias=False),
                                     pool=nn.AvgPool2d(2)))


class DenseNet(nn.Module):
    def __init__(self, growth=8, blocks=(2, 3, 6, 4), classes=10):  # densenet121: (6, 12, 24, 16)
        super().__init__()
        width = 2 * growth
        parts: list[tuple[str, nn.Module]] = [("conv0", nn.Conv2d(3, width, 3, 1, 1, bias=False)),
                                              ("norm0", nn.BatchNorm2d(width)), ("relu0", nn.ReLU())]
        for i, layers in enumerate(blocks):
            parts.append((f"denseblock{i + 1}", DenseBlock(layers, width, growth)))
            width += layers * growth
            if i < len(blocks) - 1:
                parts.append((f"transition{i + 1}", Transition(width, width // 2)))
                width //= 2
        parts.append(("norm5", nn.BatchNorm2d(width)))
        self.features = nn.Sequential(OrderedDict(parts))
        self.classifier = nn.Linear(width, classes)

    def forward(self, x):
        return self.classifier(F.adaptive_avg_pool2d(F.relu(self.features(x)), 1).flatten(1))


# -- torchvision's RegNet: trunk_output.block{i} (AnyStage, an nn.Sequential) of block{i}-{j} -------------------

class ResBottleneckBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.proj = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if cin != cout or stride != 1 else None)
        self.f = nn.Sequential(OrderedDict(a=conv_bn(cin, cout), b=conv_bn(cout, cout, stride, groups=2),
                                           c=nn.Sequential(nn.Conv2d(cout, cout, 1, bias=False), nn.BatchNorm2d(cout))))

    def forward(self, x):
        return F.relu((x if self.proj is None else self.proj(x)) + self.f(x))


class AnyStage(nn.Sequential):
    def __init__(self, cin: int, cout: int, depth: int, index: int):
        super().__init__()
        for j in range(depth):
            self.add_module(f"block{index}-{j}", ResBottleneckBlock(cin if j == 0 else cout, cout, 2 if j == 0 else 1))


class RegNet(nn.Module):
    def __init__(self, widths=(8, 16, 32, 64), depths=(1, 2, 3, 4), classes=10):
        super().__init__()
        self.stem = conv_bn(3, widths[0], 2)
        cins = (widths[0],) + widths[:-1]
        self.trunk_output = nn.Sequential(OrderedDict(
            (f"block{i + 1}", AnyStage(cin, cout, depth, i + 1)) for i, (cin, cout, depth) in enumerate(zip(cins, widths, depths))))
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        return self.fc(self.trunk_output(self.stem(x)).mean((2, 3)))


# -- torchvision's ConvNeXt: features = [stem, stage, downsample, stage, ...], each a plain nn.Sequential ------

class CNBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(dim, dim, 7, padding=3, groups=dim), LayerNorm2d(dim),
                                   nn.Conv2d(dim, 4 * dim, 1), nn.GELU(), nn.Conv2d(4 * dim, dim, 1))
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.1))

    def forward(self, x):
        return x + self.layer_scale * self.block(x)


class ConvNeXt(nn.Module):
    def __init__(self, dims=(8, 16, 32, 64), depths=(1, 1, 3, 3), classes=10):  # convnext_tiny: (3, 3, 9, 3)
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, dims[0], 2, 2), LayerNorm2d(dims[0]))]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            layers.append(nn.Sequential(*(CNBlock(dim) for _ in range(depth))))
            if i < len(dims) - 1:
                layers.append(nn.Sequential(LayerNorm2d(dim), nn.Conv2d(dim, dims[i + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(dims[-1]), nn.Flatten(1), nn.Linear(dims[-1], classes))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


# -- torchvision's MaxViT: blocks is a ModuleList of stages, each with a ModuleList of layers -----------------

class PartitionAttentionLayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attn = SelfAttention(dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        t = t + self.attn(t)
        return (t + self.mlp(t)).transpose(1, 2).reshape(b, c, h, w)


class MaxVitLayer(nn.Module):
    """torchvision's: ``layers`` is an nn.Sequential of MBconv, window_attention and grid_attention."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.layers = nn.Sequential(OrderedDict(
            MBconv=nn.Sequential(conv_bn(cin, cout, stride), nn.Conv2d(cout, cout, 1)),
            window_attention=PartitionAttentionLayer(cout), grid_attention=PartitionAttentionLayer(cout)))

    def forward(self, x):
        return self.layers(x)


class MaxVitStage(nn.Module):
    def __init__(self, cin: int, cout: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(MaxVitLayer(cin if i == 0 else cout, cout, 2 if i == 0 else 1) for i in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class MaxVit(nn.Module):
    def __init__(self, dims=(8, 16, 32, 64), depths=(1, 1, 3, 2), classes=10):  # maxvit_t: (2, 2, 5, 2)
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, dims[0]), conv_bn(dims[0], dims[0]))
        cins = (dims[0],) + dims[:-1]
        self.blocks = nn.ModuleList(MaxVitStage(cin, cout, d) for cin, cout, d in zip(cins, dims, depths))
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dims[-1]),
                                        nn.Linear(dims[-1], classes))

    def forward(self, x):
        x = self.stem(x)
        for stage in self.blocks:
            x = stage(x)
        return self.classifier(x)


# -- a UNet: down_blocks / up_blocks (ModuleLists of resnets and samplers), widest at the bottom ----------------

class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(2, cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2, self.conv2 = nn.GroupNorm(2, cout), nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.skip(x) + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))


class Sampler(nn.Module):
    def __init__(self, dim: int, down: bool):
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(dim, dim, 3, 2 if down else 1, 1)

    def forward(self, x):
        return self.conv(x if self.down else F.interpolate(x, scale_factor=2.0))


class UNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, layers: int, sampler: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(ResBlock(cin if i == 0 else cout, cout) for i in range(layers))
        self.samplers = nn.ModuleList([Sampler(cout, sampler == "down")] if sampler else [])

    def forward(self, x):
        """The output and, for the skip connection, the output before resampling (diffusers' res_samples)."""
        for resnet in self.resnets:
            x = resnet(x)
        skip = x
        for sampler in self.samplers:
            x = sampler(x)
        return x, skip


class UNet(nn.Module):
    def __init__(self, dims=(8, 16, 32), layers=2):
        super().__init__()
        self.conv_in = nn.Conv2d(3, dims[0], 3, 1, 1)
        cins = (dims[0],) + dims[:-1]
        self.down_blocks = nn.ModuleList(UNetBlock(cin, cout, layers, "down" if i < len(dims) - 1 else None)
                                         for i, (cin, cout) in enumerate(zip(cins, dims)))
        self.mid_block = ResBlock(dims[-1], dims[-1])
        ups = list(reversed(dims))
        cins = [ups[0] + ups[0]] + [ups[i - 1] + ups[i] for i in range(1, len(ups))]  # previous output + skip
        self.up_blocks = nn.ModuleList(UNetBlock(cin, cout, layers, "up" if i < len(dims) - 1 else None)
                                       for i, (cin, cout) in enumerate(zip(cins, ups)))
        self.conv_out = nn.Conv2d(dims[0], 3, 3, 1, 1)

    def forward(self, x):
        x = self.conv_in(x)
        skips = []
        for block in self.down_blocks:
            x, skip = block(x)
            skips.append(skip)
        x = self.mid_block(x)
        for block in self.up_blocks:
            x, _ = block(torch.cat([x, skips.pop()], 1))
        return self.conv_out(x)


def llama():
    from offload_compiler.testing.models import BUILDERS
    pytest.importorskip("transformers")
    model, inputs = BUILDERS["llama"]()
    return model, inputs


def image(size=16):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


ZOO = {
    "vit": lambda: (VisionTransformer(), {"x": image()}),
    "densenet": lambda: (DenseNet(), {"x": image()}),
    "regnet": lambda: (RegNet(), {"x": image()}),
    "convnext": lambda: (ConvNeXt(), {"x": image()}),
    "maxvit": lambda: (MaxVit(), {"x": image()}),
    "unet": lambda: (UNet(), {"x": image()}),
    "llama": llama,
}


def build(name):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    return model.eval(), inputs


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


# each a capture of a whole network (3 to 9 s on a 2-core machine); the fast subset offloads the ViT
@pytest.mark.parametrize("name", [n if n == "vit" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(ZOO)])
def test_layerwise_saves_on_any_model(name):
    model, inputs = build(name)
    planned = plan_groups(model, OffloadPolicy(**POLICY))
    largest_two = sum(sorted((g.nbytes for g in planned), reverse=True)[:2])
    assert largest_two <= MOST_OF_MODEL * model_bytes(model), [(g.name, g.nbytes) for g in planned]
    report = assert_offload_equivalent(model, OffloadPolicy(**POLICY), **inputs)  # outputs and traffic = the plan
    assert report.max_abs_diff == 0.0
    assert report.peak_resident_bytes <= MOST_OF_MODEL * model_bytes(model)


@pytest.mark.parametrize("name, stacks", [
    ("vit", ("encoder.layers",)), ("densenet", ("features",)), ("regnet", ("trunk_output",)),
    ("convnext", ("",)), ("maxvit", ("blocks",)), ("unet", ("down_blocks", "up_blocks")),
])
def test_stacks_are_found_with_named_children(name, stacks):
    model, _ = build(name)
    assert block_paths(model, OffloadPolicy(**POLICY)) == stacks


def test_dominant_stages_are_split_into_their_blocks():
    names = [g.name for g in plan_groups(build("regnet")[0], OffloadPolicy(**POLICY))]
    assert names[:3] == ["trunk_output.block1", "trunk_output.block2", "trunk_output.block3"]
    assert {"trunk_output.block4.block4-0", "trunk_output.block4.block4-3"} <= set(names)
    assert "trunk_output.block4" not in names  # the stage holds nothing but its blocks
    names = [g.name for g in plan_groups(build("densenet")[0], OffloadPolicy(**POLICY))]
    assert "features.denseblock3.denselayer6" in names and "features.conv0" in names


def test_blocks_attr_names_a_sequential_with_named_children():
    model, _ = build("vit")
    policy = OffloadPolicy(**POLICY, blocks_attr="encoder.layers", blocks_per_group=2)
    blocks = [g.name for g in plan_groups(model, policy) if g.is_block]
    assert blocks == ["encoder.layers.encoder_layer_0-encoder_layer_1", "encoder.layers.encoder_layer_2-encoder_layer_3",
                      "encoder.layers.encoder_layer_4-encoder_layer_5"]


class OneGiantLayer(nn.Module):
    """Small blocks and a head that holds almost every byte: no grouping saves anything."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 4096)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_plan_that_saves_little_is_warned_about_before_running():
    model = OneGiantLayer()
    with pytest.warns(OffloadSavingWarning, match=r"layerwise keeps up to \d+% .*'head', holds 99%.*'head' \(a Linear\) holds no stack of blocks.*blocks_attr=") as record:
        offloaded = offload_compile(model, OffloadPolicy(**POLICY))
    assert record[0].filename == __file__  # the user's line
    assert "device weight peak" in describe_plan(offloaded) and "estimated" in describe_plan(offloaded)
    offloaded(torch.randn(2, 8))
    assert "verified" in describe_plan(offloaded)


def test_coarse_blocks_per_group_is_named_as_the_fix():
    model, _ = build("vit")
    with pytest.warns(OffloadSavingWarning, match=r"'encoder.layers.encoder_layer_0-encoder_layer_5'.*blocks_per_group=1"):
        offload_compile(model, OffloadPolicy(**POLICY, blocks_per_group=6))


class WideBlocks(nn.Module):
    """Two blocks, each an nn.Sequential of single layers: no stack of blocks inside them, but layers to name."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_stack_inside_the_largest_group_is_named_as_the_fix():
    with pytest.warns(OffloadSavingWarning, match=r"'blocks.0'.*Fix: blocks_attr=\('blocks', 'blocks.0'\)"):
        offload_compile(WideBlocks(), OffloadPolicy(**POLICY))
    names = [g.name for g in plan_groups(WideBlocks(), OffloadPolicy(**POLICY, blocks_attr=("blocks", "blocks.0")))]
    assert names == ["blocks.0.0", "blocks.0.2", "blocks.1"]  # nested stacks: a weight is in the innermost block


def test_declared_stacks_are_honoured_and_a_dominant_block_still_split():
    model, _ = build("regnet")
    names = [g.name for g in plan_groups(model, OffloadPolicy(**POLICY, blocks_attr="trunk_output"))]
    assert names[0] == "trunk_output.block1" and "trunk_output.block4.block4-2" in names


@pytest.mark.slow  # RegNet captured
def test_budget_splits_the_block_that_would_overshoot_offload_gb(recwarn):
    """A quarter of RegNet ends inside its last stage: that stage is split there, so budget streams close to
    the quarter (not the whole stage), and runs as the plain model."""
    model, inputs = build("regnet")
    target = model_bytes(model) / 4
    policy = OffloadPolicy(strategy="budget", device="cpu", compiler="eager", offload_gb=target / 2**30)
    groups = plan_groups(model, policy)
    streamed = [g.name for g in groups if g.streamed]
    assert streamed[:3] == ["trunk_output.block1", "trunk_output.block2", "trunk_output.block3"]
    assert streamed[3].startswith("trunk_output.block4.block4-0")  # part of the last stage, not all of it
    assert target <= sum(g.nbytes for g in groups if g.streamed) <= 1.25 * target
    assert_offload_equivalent(model, policy, **inputs)
    # not warned for overshooting; warned that it saves little: with prefetch=1, block3 and the next group
    # (a third of what it streams) are on the device at once
    warned = [str(w.message) for w in recwarn if issubclass(w.category, OffloadSavingWarning)]
    assert not [m for m in warned if "budget streams" in m] and all("prefetch=1 holds 2" in m for m in warned)


def test_budget_far_from_offload_gb_is_warned_about():
    model = OneGiantLayer()
    with pytest.warns(OffloadSavingWarning, match=r"budget streams .* offload_gb"):
        offload_compile(model, OffloadPolicy(strategy="budget", device="cpu", offload_gb=model_bytes(model) / 2 / 2**30))


def four_layer_llama() -> tuple[nn.Module, dict, int]:
    """A tiny transformers Llama of 4 equal decoder layers, its inputs and one layer's bytes."""
    pytest.importorskip("transformers")
    from offload_compiler.testing.models import llama as build_llama
    model, inputs = build_llama(layers=4)
    return model, inputs, model_bytes(model.model.layers[0])


def saved_bytes(offloaded: nn.Module) -> int:
    """Device weight bytes the plan saves: the model less its device weight peak (verified once it ran)."""
    saving = plan_summary(offloaded)["saving"]
    return round(saving["device_weight_peak_bytes"] / saving["share_of_model"]) - saving["device_weight_peak_bytes"]


def test_budget_that_streams_no_more_than_the_prefetch_holds_is_warned_about():
    """offload_gb of two decoder layers with prefetch=1: the streamed layer computing and the one prefetched are
    on the device at once, so budget saves nothing (verified: the whole model is on the device). The warning says
    so and names an offload_gb that saves what was asked; that one does not warn, and saves it."""
    model, inputs, layer = four_layer_llama()
    policy = OffloadPolicy(strategy="budget", device="cpu", compiler="eager", prefetch=1, offload_gb=2 * layer / 2**30)
    with pytest.warns(OffloadSavingWarning, match=r"budget saves no device memory .*prefetch=1 holds 2 streamed .*"
                                                  r"Fix: offload_gb=[\d.e-]+ or more.*; or prefetch=0") as record:
        offloaded = offload_compile(model, policy)
    offloaded(**inputs)
    assert saved_bytes(offloaded) <= 0
    fixed_gb = float(re.search(r"Fix: offload_gb=([\d.e-]+)", str(record[0].message)).group(1))
    model, inputs, _ = four_layer_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadSavingWarning)
        fixed = offload_compile(model, policy.replace(offload_gb=fixed_gb))
    fixed(**inputs)
    assert saved_bytes(fixed) >= 2 * layer


def test_budget_that_overshoots_and_saves_nothing_is_warned_about_both():
    """offload_gb of half a decoder layer: budget streams a whole layer (an overshoot), and with prefetch=1 that
    layer and the one prefetched are on the device at once, so it saves nothing (verified). One warning says both, the saving's fix included."""
    model, inputs, layer = four_layer_llama()
    policy = OffloadPolicy(strategy="budget", device="cpu", compiler="eager", prefetch=1, offload_gb=layer / 2 / 2**30)
    with pytest.warns(OffloadSavingWarning) as record:
        offloaded = offload_compile(model, policy)
    offloaded(**inputs)
    assert saved_bytes(offloaded) <= 0
    warned = [str(w.message) for w in record if issubclass(w.category, OffloadSavingWarning)]
    assert len(warned) == 1
    assert re.search(r"budget streams .* offload_gb=.*Also: budget saves no device memory .*prefetch=1 holds 2", warned[0])


def test_budget_with_one_group_of_prefetch_names_no_prefetch_0_that_saves_nothing():
    """One layer streamed: prefetch=0 would hold it alone, saving nothing too, so it is not offered."""
    model, _, layer = four_layer_llama()
    with pytest.warns(OffloadSavingWarning, match=r"saves no device memory") as record:
        offload_compile(model, OffloadPolicy(strategy="budget", device="cpu", offload_gb=layer / 2**30))
    assert "prefetch=0" not in str(record[0].message)


def test_budget_that_saves_what_it_asks_does_not_warn(recwarn):
    model, _, layer = four_layer_llama()
    offload_compile(model, OffloadPolicy(strategy="budget", device="cpu", prefetch=0, offload_gb=2 * layer / 2**30))
    assert not [w for w in recwarn if issubclass(w.category, OffloadSavingWarning)]


def test_a_plan_that_saves_does_not_warn(recwarn):
    model, _ = build("vit")
    offload_compile(model, OffloadPolicy(**POLICY))
    # half of RegNet with prefetch=0: its last stage's blocks are 22% of it each, and prefetch=1 would hold two
    offload_compile(build("regnet")[0], OffloadPolicy(strategy="budget", device="cpu", prefetch=0,
                                                      offload_gb=model_bytes(build("regnet")[0]) / 2 / 2**30))
    assert not [w for w in recwarn if issubclass(w.category, OffloadSavingWarning)]


def test_budget_past_offload_gb_by_one_piece_names_the_budget_that_stops_before_it():
    """A budget that streams whole groups until offload_gb is reached passes it by up to one group; where that
    group is one piece the fix names the offload_gb that stops before it -- never strategy='budget', the plan in
    effect -- and that budget streams exactly the groups before it, with no warning of streaming past it."""
    model, inputs, layer = four_layer_llama()
    policy = OffloadPolicy(strategy="budget", device="cpu", compiler="eager", prefetch=0, offload_gb=1.5 * layer / 2**30)
    with pytest.warns(OffloadSavingWarning, match=r"budget streams .* offload_gb") as record:
        offload_compile(model, policy)
    message = str(record[0].message)
    assert "strategy='budget'" not in message
    stop = float(re.search(r"offload_gb=([\d.e-]+) streams the groups before", message).group(1))
    model, inputs, _ = four_layer_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fixed = offload_compile(model, policy.replace(offload_gb=stop))
    assert not [w for w in caught if "budget streams" in str(w.message)]
    streamed = sum(g.nbytes for g in fixed._offload_runtime.groups if g.streamed)
    assert streamed == layer  # the layer before the second, which passed 1.5 layers
