"""The verifier's tests: never in the episode's baseline, so no episode can read or edit them."""

import unittest

from calc import mean, median


class HiddenTests(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([2, 4]), 3)

    def test_median_odd(self):
        self.assertEqual(median([5, 1, 3]), 3)

    def test_median_even_sorted(self):
        self.assertEqual(median([1, 2, 3, 4]), 2.5)

    def test_median_even_unsorted(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_median_single(self):
        self.assertEqual(median([7]), 7)

    def test_median_empty(self):
        with self.assertRaises(ValueError):
            median([])

    def test_median_does_not_modify_its_input(self):
        data = [3, 1, 2]
        median(data)
        self.assertEqual(data, [3, 1, 2])
