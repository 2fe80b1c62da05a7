"""A small multi-stage model shaped like Qwen2.5-Omni (thinker with visual and audio encoders, talker,
token2wav), and a code2wav stage model loaded on its own (a vocoder: codes to a waveform, none of the known
component names inside), for component tests and the CLI's --model pkg.module:fn."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, i, o, h=32):
        super().__init__()
        self.a, self.b = nn.Linear(i, h), nn.Linear(h, o)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Thinker(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual, self.audio_tower = MLP(12, 16, 64), MLP(10, 16, 48)
        self.language_model, self.lm_head = MLP(16, 16), nn.Linear(16, 20)

    def forward(self, pixels, audio, embeds):
        h = torch.cat([self.visual(pixels), self.audio_tower(audio), embeds], 1)
        return self.lm_head(self.language_model(h))


class Omni(nn.Module):
    def __init__(self):
        super().__init__()
        self.thinker, self.talker, self.token2wav = Thinker(), MLP(20, 8, 96), MLP(8, 4, 80)

    def forward(self, pixels, audio, embeds):
        return self.token2wav(self.talker(self.thinker(pixels, audio, embeds)))


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, 12, generator=g), torch.randn(1, 2, 10, generator=g), torch.randn(1, 4, 16, generator=g)


def thinker():
    torch.manual_seed(0)
    return Thinker().eval(), inputs()


def omni():
    torch.manual_seed(0)
    return Omni().eval(), inputs()


class Code2Wav(nn.Module):
    """A code2wav stage as vllm-omni loads it: one model, codes embedded, convolved and upsampled to a waveform."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.pre = nn.Conv1d(16, 24, 3, padding=1)
        self.up = nn.ConvTranspose1d(24, 12, 4, stride=2, padding=1)
        self.post = nn.Conv1d(12, 1, 3, padding=1)

    def forward(self, codes):
        h = torch.relu(self.pre(self.embed(codes).transpose(1, 2)))
        return torch.tanh(self.post(torch.relu(self.up(h))))


def code2wav():
    torch.manual_seed(0)
    return Code2Wav().eval(), (torch.randint(0, 32, (1, 10), generator=torch.Generator().manual_seed(1)),)
