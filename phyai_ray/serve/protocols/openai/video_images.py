"""The images a video job may start from (`input_reference`): read, bounded, as uint8 [H, W, 3].

    image_of(png_bytes)                                        a file from a multipart form
    reference_image({"image_url": "data:image/png;base64,..."})  the JSON body's form

An image of more than MAX_IMAGE_PIXELS pixels is a 400 naming its size, read from its header before
anything is decoded (PIL's own decompression-bomb bound, met while it opens a file, is the same 400);
one that is not an image PIL reads is a 400 too; file ids and remote URLs are never fetched.
"""

from __future__ import annotations

import base64
import io
import re
from typing import Any

import numpy as np

from phyai_ray.serve.protocols.openai.common import OpenAIError

MAX_IMAGE_PIXELS = 4096 * 4096  # an input_reference past this is a 400 (decoded, 4096^2 RGB is 48 MiB)


def image_of(data: bytes, param: str = "input_reference") -> np.ndarray:
    """An uploaded image (PNG, JPEG, WebP) as uint8 [H, W, 3]; one of more than MAX_IMAGE_PIXELS pixels
    (its header says, before anything is decoded) is a 400."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as picture:
            width, height = picture.size
            if width * height > MAX_IMAGE_PIXELS:
                raise OpenAIError(400, _too_large(param, width, height), param=param)
            return np.asarray(picture.convert("RGB"), dtype=np.uint8).copy()
    except Image.DecompressionBombError as exc:  # PIL's own bound, met while it opens the file
        size = re.search(r"\((\d+) pixels\)", str(exc))
        raise OpenAIError(400, _too_large(param, None, None, int(size.group(1)) if size else None),
                          param=param) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise OpenAIError(400, f"{param} is not an image this server can read (PNG, JPEG, WebP): {exc}",
                          param=param) from None


def _too_large(param: str, width: int | None, height: int | None, pixels: int | None = None) -> str:
    shape = f"{width} x {height} = {width * height} pixels" if width and height else f"{pixels or 'too many'} pixels"
    return (f"{param} is {shape}, past this server's limit of {MAX_IMAGE_PIXELS} pixels (4096 x 4096); send a "
            "smaller image (the pipeline resizes it to the video's size anyway)")


def reference_image(value: Any) -> np.ndarray | None:
    """input_reference of a JSON body: {"image_url": "data:image/...;base64,..."} (file ids are OpenAI's own)."""
    if value is None:
        return None
    url = value.get("image_url") if isinstance(value, dict) else None
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise OpenAIError(400, "input_reference must be an uploaded file (multipart form) or "
                          "{'image_url': 'data:image/png;base64,...'}; file ids and remote URLs are not fetched",
                          param="input_reference")
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except ValueError:
        raise OpenAIError(400, "input_reference's data URL is not valid base64", param="input_reference") from None
    return image_of(data)
