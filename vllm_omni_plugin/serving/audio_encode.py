"""Speech out as OpenAI's chat formats: mono float samples -> wav, pcm16, flac, mp3, opus, aac.

pcm16 (raw little-endian 16-bit, what OpenAI streams) is written here and wav by the standard
library's `wave`; flac, mp3, opus
(Ogg) and aac (ADTS) through PyAV, whose wheels bundle FFmpeg with these encoders (PyAV is
already the plugin's MP4 encoder). Samples are clipped to [-1, 1] first.
"""

from __future__ import annotations

import io
import wave

import numpy as np

# OpenAI's audio output formats; each maps to (container, codec, media type).
_AV_FORMATS = {
    "flac": ("flac", "flac", "audio/flac"),
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
}
FORMATS = ("wav", "pcm16", *_AV_FORMATS)
MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm16": "audio/pcm",
    **{k: v[2] for k, v in _AV_FORMATS.items()},
}
# libopus takes 8, 12, 16, 24 or 48 kHz; Qwen3-Omni speaks at 24 kHz.
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def to_pcm16(samples: np.ndarray) -> bytes:
    """Raw little-endian signed 16-bit mono samples."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (np.round(clipped * 32767.0)).astype("<i2").tobytes()


def wav_bytes(pcm16: bytes, sample_rate: int) -> bytes:
    """A RIFF/WAVE file around 16-bit mono PCM (the canonical 44-byte header)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm16)
    return buf.getvalue()


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """The whole answer's audio as one file of `fmt` (one of FORMATS)."""
    pcm = to_pcm16(samples)
    if fmt == "pcm16":
        return pcm
    if fmt == "wav":
        return wav_bytes(pcm, sample_rate)
    if fmt not in _AV_FORMATS:
        raise ValueError(f"unsupported audio format {fmt!r}; supported: {', '.join(FORMATS)}")
    if fmt == "opus" and sample_rate not in _OPUS_RATES:
        raise ValueError(f"opus cannot encode {sample_rate} Hz audio")
    return _encode_av(np.frombuffer(pcm, dtype="<i2"), sample_rate, fmt)


def _encode_av(pcm: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    import av

    container_fmt, codec, _ = _AV_FORMATS[fmt]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_fmt) as container:
        stream = container.add_stream(codec, rate=sample_rate)
        stream.layout = "mono"
        frame_size = stream.codec_context.frame_size or 1024
        for start in range(0, max(len(pcm), 1), frame_size):
            chunk = pcm[start : start + frame_size]
            if len(chunk) < frame_size and fmt != "flac":
                # Fixed-size codecs (mp3, aac, opus) need whole frames: pad the last one.
                chunk = np.concatenate([chunk, np.zeros(frame_size - len(chunk), "<i2")])
            frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = sample_rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()
