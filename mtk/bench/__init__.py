"""``mtk bench``: step time, tokens/s, memory and collectives of a layout, next to its peers."""
