"""pagoda's n-gram (prompt lookup) speculative decoding proposer."""
