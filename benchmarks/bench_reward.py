"""A cheap, deterministic reward for benchmarks: the response's share of even token ids (words `w{id}`)."""


def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    words = solution_str.split()
    return sum(int(word[1:]) % 2 == 0 for word in words if word[1:].isdigit()) / max(len(words), 1)
