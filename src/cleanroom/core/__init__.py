"""The bottom layer: the states an episode moves through and the one exception -> outcome map."""
