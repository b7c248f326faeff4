"""Voices: a voice prompt's keys and values, computed once and registered as the caches' shared source.

A voice is a prompt of `P` codec frames (and its mel). Both caches read it in place from their
source banks at index `voice.index`: every request speaking with that voice shares one copy. Prompts
are random here (the model is random too); what matters is that they go through the model exactly as
a real prompt would.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mstar_jax.checks import check_int, is_int
from mstar_jax.distributed import host_local
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.resources.kv.bounded.config import StreamPosition
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager

__all__ = ["Voice", "VoiceBank"]


@dataclasses.dataclass(frozen=True)
class Voice:
    """A registered voice: its bank index and prompt length (frames, the source length of both caches)."""

    index: int
    frames: int

    def __post_init__(self):
        for name, minimum in (("index", 0), ("frames", 1)):
            check_int(f"Voice {name}", getattr(self, name), minimum=minimum)

    def position(self, written: int) -> StreamPosition:
        """The stream position of a request of this voice that has written `written` entries."""
        return StreamPosition(self.frames, written, self.index)


class VoiceBank:
    """Registers voices in the talker's and the flow's source banks.

    Args:
      model: computes the prompts' keys and values.
      talker, flow: the two caches' managers.
    """

    def __init__(self, model: StreamingTTSModel, talker: BoundedKVManager, flow: BoundedKVManager):
        self.model, self.talker, self.flow = model, talker, flow
        self.voices: dict[int, Voice] = {}

    @property
    def capacity(self) -> int:
        return min(self.talker.bank.num_sources, self.flow.bank.num_sources)

    def add(self, index: int, *, frames: int, seed: int) -> Voice:
        """Compute a random voice prompt of `frames` frames (drawn from `seed`) and register it at `index`.

        Replaces a voice already there (unless live requests read it).

        Raises:
          ValueError: a bad index, `frames` outside `[min_voice_frames, max_voice_frames]`, a bad seed,
            or a voice in use; nothing is registered then.
        """
        cfg = self.model.config
        check_int("voice index", index, minimum=0, below=self.capacity)
        if not is_int(frames) or not cfg.min_voice_frames <= frames <= cfg.max_voice_frames:
            raise ValueError(
                f"voice frames={frames!r} must be in [min_voice_frames={cfg.min_voice_frames}, "
                f"max_voice_frames={cfg.max_voice_frames}], an int"
            )
        check_int("voice seed", seed, minimum=0)
        for manager in (self.talker, self.flow):
            readers = manager.readers(index)
            if readers:
                raise ValueError(f"voice {index} is read by {readers} live request(s); remove them first")
        rng = np.random.default_rng(seed)
        length, padded = frames, cfg.max_voice_frames
        codes = np.zeros(padded, np.int32)
        codes[:length] = rng.integers(0, cfg.codec_vocab_size, length)
        mel = np.zeros((padded, cfg.mel_bins), np.float32)
        mel[:length] = rng.standard_normal((length, cfg.mel_bins))
        noise = rng.standard_normal((padded, cfg.mel_bins)).astype(np.float32)
        talker_fn, flow_fn = self.model.jitted_voice_kv
        tk, tv = talker_fn(self.model.talker_params, self.model.code_tokens(codes), jnp.int32(length))
        fk, fv = flow_fn(self.model.flow_params, codes, mel, noise, jnp.int32(length))
        # [L, R, G, P, D] -> per layer; on a mesh over processes each holds every entry (replicated on data)
        cut = lambda x: list(host_local(x)[..., :length, :])  # noqa: E731
        self.talker.register_source(index, cut(tk), cut(tv))
        self.flow.register_source(index, cut(fk), cut(fv))
        voice = Voice(index, frames)
        self.voices[index] = voice
        return voice

    def remove(self, index: int) -> None:
        """Forget a voice (ValueError if live requests read it)."""
        self.talker.remove_source(index)
        self.flow.remove_source(index)
        self.voices.pop(index, None)
