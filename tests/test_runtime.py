"""The launch's choice of cluster size (no GPU: the device's cluster occupancy is made up)."""

from __future__ import annotations

import ctypes

import pytest

from specgen import runtime


def kernel(largest: int, boxes: int) -> runtime.LoadedKernel:
    return runtime.LoadedKernel(ctypes.c_void_p(), ctypes.c_void_p(), 512, 200_000, 0, (largest, boxes))


# Clusters of one-block-per-SM blocks an H200 holds at once (measured with cuOccupancyMaxActiveClusters):
# 8-block clusters leave 12 of its 132 SMs idle.
H200 = {1: 132, 2: 66, 4: 30, 8: 15, 16: 7}


@pytest.fixture
def h200(monkeypatch):
    calls = []

    def held(k, c):
        calls.append(c)
        return H200[c]

    monkeypatch.setattr(runtime, "_max_active_clusters", held)
    return calls


@pytest.mark.parametrize(
    "clusters, expected",
    [
        (1, 16),  # one sample: spread its 48 boxes over 16 blocks (3 each)
        (8, 8),  # 8 clusters of 8 fit at once (6 boxes each); of 16, 7 fit and one waits
        (30, 4),  # 30 clusters of 4 fit at once (12 boxes each)
        (128, 1),  # a large batch fills the GPU with one block per sample
    ],
)
def test_cluster_size_minimizes_waves_times_boxes(h200, clusters, expected):
    k = kernel(16, 48)
    assert k.cluster_size(clusters) == expected
    assert sorted(set(h200)) == [1, 2, 4, 8, 16]


def test_cluster_size_is_memoized_per_launch_size(h200):
    k = kernel(16, 48)
    k.cluster_size(30)
    asked = len(h200)
    assert k.cluster_size(30) == 4 and len(h200) == asked


def test_cluster_sizes_tried_include_a_largest_that_is_not_a_power_of_two(h200, monkeypatch):
    monkeypatch.setattr(runtime, "_max_active_clusters", lambda k, c: {1: 132, 2: 66, 3: 44}[c])
    assert kernel(3, 3).cluster_size(1) == 3


def test_sizes_the_device_cannot_hold_are_skipped(monkeypatch):
    monkeypatch.setattr(runtime, "_max_active_clusters", lambda k, c: 0 if c > 8 else H200[c])
    assert kernel(16, 48).cluster_size(1) == 8  # a device without clusters of 16


def test_a_device_that_answers_nothing_gets_a_portable_cluster(monkeypatch):
    monkeypatch.setattr(runtime, "_max_active_clusters", lambda k, c: 0)
    assert kernel(16, 48).cluster_size(1) == 8
