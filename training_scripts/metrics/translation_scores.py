"""BLEU and chrF of translations (sacreBLEU's corpus scores), as a local `evaluate` module.

    metric = evaluate.load("training_scripts/metrics/translation_scores.py")
    metric.compute(predictions=["le chat"], references=[["le chat"]])  # {"bleu": 100.0, "chrf": 100.0}

`evaluate.load("sacrebleu")` fetches the module from the Hub; this one works offline.
"""

import datasets
import evaluate
import sacrebleu


class TranslationScores(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus BLEU and chrF from sacreBLEU.",
            citation="Post, 2018. A Call for Clarity in Reporting BLEU Scores.",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def _compute(self, predictions, references):
        # sacreBLEU wants one list per reference position, not per prediction.
        streams = [list(refs) for refs in zip(*references)]
        return {
            "bleu": sacrebleu.corpus_bleu(predictions, streams).score,
            "chrf": sacrebleu.corpus_chrf(predictions, streams).score,
        }
