"""MP4 (H.264, yuv420p) from PIL frames through PyAV (FFmpeg's own encoder), in memory."""

from __future__ import annotations

import io

from PIL import Image


def encode_mp4(frames: list[Image.Image], fps: int) -> bytes:
    import av

    if not frames:
        raise ValueError("a video needs at least one frame")
    width, height = frames[0].size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"  # what every player decodes; sizes are multiples of 16
        stream.options = {"crf": "18"}
        for frame in frames:
            picture = av.VideoFrame.from_image(frame.convert("RGB"))
            container.mux(stream.encode(picture))
        container.mux(stream.encode(None))
    return buf.getvalue()
