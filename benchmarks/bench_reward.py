"""Cheap, deterministic rewards for benchmarks on the word tokenizer (words `w{id}`)."""


def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The response's share of even token ids."""
    words = solution_str.split()
    return sum(int(word[1:]) % 2 == 0 for word in words if word[1:].isdigit()) / max(len(words), 1)


def score_short(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Pays for stopping early: 1 / (1 + words), so a response of 9 words scores 0.1."""
    return 1.0 / (1 + len(solution_str.split()))
