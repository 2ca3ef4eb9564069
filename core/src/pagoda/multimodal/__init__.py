"""Multimodal inputs (images) for models that declare ``SupportsMultiModal`` (docs/multimodal.md).

``inputs``: the typed record a request carries; ``hashing``: content hashes of items; ``processing``: the
front end's processor (transformers' ``AutoProcessor``) and its cache; ``media``: images from URLs under the
server's media policy.
"""

from pagoda.multimodal.inputs import MultiModalFeature, MultiModalInputs, PlaceholderRange

__all__ = ["MultiModalFeature", "MultiModalInputs", "PlaceholderRange"]
