"""Entry point of the BERT-family plugin: encoder architectures -> classes (imported lazily), runner 'pooling'."""

from pagoda.plugins import ModelSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"

_ARCHITECTURES = (
    "BertModel",
    "BertForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
)


@hookimpl
def pagoda_register_model_families() -> list[ModelSpec]:
    # encoder-only models pool (embeddings, classification, scores); they never generate
    return [ModelSpec(architecture=arch, cls=f"pagoda_models_bert.bert:{arch}", runner="pooling")
            for arch in _ARCHITECTURES]
