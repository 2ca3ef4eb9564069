"""Images named by URL in chat content parts (``image_url``), under the server's media policy.

``data:`` URLs are always read (the bytes are in the request). ``file://`` only under
``allowed_local_media_path`` (vLLM's ``--allowed-local-media-path``) and ``http(s)://`` only from a host in
``allowed_media_domains`` (vLLM's ``--allowed-media-domains``); anything else is refused before any read or
fetch. A fetch has a timeout and a size limit; an image is decoded fully here, so a broken one is the
caller's error (ValueError), never the engine's.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# media types the data: URL path accepts (what PIL decodes and LLaVA's processor takes)
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how much a fetch may read."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = field(default_factory=tuple)
    fetch_timeout: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024

    @classmethod
    def from_model_config(cls, model_config: Any) -> MediaPolicy:
        """The policy of ``allowed_local_media_path`` / ``allowed_media_domains`` (engine arguments, as vLLM's)."""
        return cls(allowed_local_media_path=model_config.allowed_local_media_path,
                   allowed_media_domains=tuple(d.lower() for d in model_config.allowed_media_domains or ()))

    def load_image(self, url: Any) -> Any:
        """-> a decoded ``PIL.Image`` (RGB as the processors expect it); ValueError when refused or broken."""
        if not isinstance(url, str) or not url:
            raise ValueError("image_url.url must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_image(self._read_data_url(url))
        if scheme == "file":
            return decode_image(self._read_file(url))
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url))
        raise ValueError(f"image_url scheme {scheme or url[:16]!r} is not supported: use a data: URL, or http(s):// "
                         "or file:// where the server allows them")

    def _read_data_url(self, url: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise ValueError("a data: URL needs a ',' before its payload")
        parts = header.split(";")
        media_type = parts[0].lower() or "text/plain"
        if media_type not in IMAGE_MEDIA_TYPES:
            raise ValueError(f"unsupported media type {media_type!r} in the data: URL; supported: "
                             f"{', '.join(IMAGE_MEDIA_TYPES)}")
        if "base64" not in parts[1:]:
            raise ValueError("an image data: URL must be base64-encoded (data:image/png;base64,...)")
        if len(payload) > self.max_image_bytes * 4 // 3 + 4:
            raise ValueError(f"the image is larger than this server's limit of {self.max_image_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"the data: URL's base64 payload does not decode: {exc}") from None

    def _read_file(self, url: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ValueError("file:// image URLs are refused: the server was not started with "
                             "--allowed-local-media-path")
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
        root = Path(self.allowed_local_media_path).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"file:// image URLs must be under --allowed-local-media-path ({root})")
        if not path.is_file():
            raise ValueError(f"no such image file under the allowed media path: {path.name}")
        if path.stat().st_size > self.max_image_bytes:
            raise ValueError(f"the image is larger than this server's limit of {self.max_image_bytes} bytes")
        return path.read_bytes()

    def _fetch(self, url: str) -> bytes:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if host not in self.allowed_media_domains:
            raise ValueError(f"image URL host {host!r} is not allowed: the server fetches only from "
                             "--allowed-media-domains")
        request = urllib.request.Request(url, headers={"User-Agent": "pagoda"})
        try:
            # no redirects out of the allowed hosts: urllib follows them, so the final host is checked too
            with urllib.request.urlopen(request, timeout=self.fetch_timeout) as response:  # noqa: S310 (scheme checked)
                final = (urllib.parse.urlparse(response.geturl()).hostname or "").lower()
                if final not in self.allowed_media_domains:
                    raise ValueError(f"the image URL redirected to host {final!r}, which is not allowed")
                data = response.read(self.max_image_bytes + 1)
        except ValueError:
            raise
        except OSError as exc:  # URLError, timeouts, HTTP errors
            raise ValueError(f"the image could not be fetched from {host}: {exc}") from None
        if len(data) > self.max_image_bytes:
            raise ValueError(f"the image is larger than this server's limit of {self.max_image_bytes} bytes")
        return data


def decode_image(data: bytes) -> Any:
    """Bytes -> an RGB ``PIL.Image``, fully decoded (a truncated file fails here, not in the processor)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image could not be decoded: {exc}") from None
    return image.convert("RGB")
