"""pagoda's suffix decoding speculative proposer."""
