"""The quality recipe's measures of a scoring: held-out pairwise accuracy (with the original's
draw margin, by pair type), rank correlations and NDCG against the gold images' ranks and true
quality, each next to the win-rate baseline."""

from __future__ import annotations

from functools import partial

import torch

from recipes.quality.data import quality_rank

DRAW_MARGIN = 0.1  # the original's draw margin in its accuracy (loss.py 48, infer.py 115)


def rank_correlations(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Spearman's rho and Kendall's tau-b, both with ties handled (scipy): tied scores share
    their average rank, so the result does not depend on the order of the rows. The win-rate
    baseline ties often; breaking its ties arbitrarily would understate it."""
    from scipy.stats import kendalltau, spearmanr

    x, y = a.double().numpy(), b.double().numpy()
    return float(spearmanr(x, y).statistic), float(kendalltau(x, y, variant="b").statistic)


def win_rates(records: list, index: dict) -> torch.Tensor:
    """The baseline: each image's share of wins (draws count half) in the training votes."""
    wins, seen = torch.zeros(len(index)), torch.zeros(len(index))
    for a, b, choice, *_ in records:
        wins[index[a]] += (1 + choice) / 2
        wins[index[b]] += (1 - choice) / 2
        seen[index[a]] += 1
        seen[index[b]] += 1
    return wins / seen.clamp(min=1)


def pairwise_accuracy(scores: torch.Tensor, records: list, index: dict) -> float:
    """Share of held-out non-draw votes whose winner has the higher score (the original's
    evaluate.py, by pair type)."""
    decided = [(index[a], index[b], c) for a, b, c, *_ in records if c != 0]
    hits = [(scores[i] - scores[j]).sign().item() == c for i, j, c in decided]
    return sum(hits) / max(1, len(hits))


def margin_accuracy(scores: torch.Tensor, records: list, index: dict, margin: float) -> float:
    """The original's accuracy (loss.py 161-169), draws included: a difference within the
    margin (0.1) predicts a draw, beyond it the higher score's image."""
    if not records:
        return 0.0
    i = torch.tensor([index[r[0]] for r in records])
    j = torch.tensor([index[r[1]] for r in records])
    diff = scores[i] - scores[j]
    predicted = (diff > margin).long() - (diff < -margin).long()
    return (predicted == torch.tensor([r[2] for r in records])).float().mean().item()


def linear_ndcg(truth: torch.Tensor, scores: torch.Tensor) -> float:
    """The original's global NDCG (compute_ndcg.py 27-47): relevance = the true value, images
    ranked by score, gain rel / log2(rank + 1), divided by the ideal order's."""
    discount = torch.log2(torch.arange(2, len(truth) + 2, dtype=torch.float64))
    gain = truth.double()
    ideal = (gain.sort(descending=True).values / discount).sum()
    actual = (gain[scores.double().argsort(descending=True)] / discount).sum()
    return (actual / ideal).item() if ideal > 0 else 0.0


def against(metrics: dict, name: str, scores, baseline, measure) -> None:
    """metrics[name] for the model and metrics[baseline_name] for the win-rate baseline."""
    metrics[name], metrics[f"baseline_{name}"] = measure(scores), measure(baseline)


def evaluate(
    scores: torch.Tensor,
    train_records: list,
    held_out: list,
    index: dict,
    truth: dict | None,
    names: list[str],
    categories: dict[str, str] | None = None,
) -> dict[str, float]:
    """Held-out pairwise accuracy (non-draw votes; with the original's 0.1 draw margin, draws
    included; by pair type, gold_gold among them, where records name one), the rank correlation
    and NDCG against gold images' category ranks (where records name categories) and against
    true quality (truth.json), each next to the win-rate baseline."""
    baseline = win_rates(train_records, index)
    metrics: dict[str, float] = {}
    against(metrics, "pair_acc", scores, baseline, lambda s: pairwise_accuracy(s, held_out, index))
    margin = partial(margin_accuracy, records=held_out, index=index, margin=DRAW_MARGIN)
    against(metrics, "pair_acc_margin", scores, baseline, margin)
    for kind in sorted({r.pair_type for r in held_out} - {""}):
        votes = [r for r in held_out if r.pair_type == kind]
        measure = partial(pairwise_accuracy, records=votes, index=index)
        against(metrics, f"pair_acc_{kind}", scores, baseline, measure)
    ranked = [(index[n], quality_rank(c)) for n, c in (categories or {}).items() if n in index]
    ranked = [(i, rank) for i, rank in ranked if rank >= 0]
    if len(ranked) > 1:  # the gold ranking: the categories' ranks
        at = torch.tensor([i for i, _ in ranked])
        gold = torch.tensor([float(rank) for _, rank in ranked])
        for key, measure in correlations_and_ndcg(gold).items():
            against(metrics, f"{key}_gold", scores[at], baseline[at], measure)
    if truth is not None:
        true_quality = torch.tensor([truth["quality"][name] for name in names])
        for key, measure in correlations_and_ndcg(true_quality).items():
            against(metrics, key, scores, baseline, measure)
    return metrics


def correlations_and_ndcg(truth: torch.Tensor) -> dict:
    """Spearman, Kendall and linear NDCG of scores against `truth`, by name."""
    return {
        "spearman": lambda s: rank_correlations(s, truth)[0],
        "kendall": lambda s: rank_correlations(s, truth)[1],
        "ndcg": lambda s: linear_ndcg(truth, s),
    }
