"""``nvidia-smi`` output recorded on real machines, as published in public logs and READMEs
(found through the search tool's code index): ``--query-gpu=name,memory.total --format=csv``
lines and two ``topo -m`` matrices (an 8 x H200 HGX node, a 4-GPU PCIe host)."""

# (nvidia-smi line, kind, memory GiB)
RECORDED = [
    ("NVIDIA A100-SXM4-80GB, 81920 MiB", "a100-sxm-80gb", 80.0),
    ("NVIDIA A100-SXM4-40GB, 40960 MiB", "a100-sxm-40gb", 40.0),
    ("NVIDIA A100-PCIE-40GB, 40960 MiB", "a100-pcie-40gb", 40.0),
    ("NVIDIA A100 80GB PCIe, 81920 MiB", "a100-pcie-80gb", 80.0),
    ("NVIDIA H100 80GB HBM3, 81559 MiB", "h100-sxm-80gb", 79.65),
    ("NVIDIA H100 PCIe, 81559 MiB", "h100-pcie-80gb", 79.65),
    ("NVIDIA H100 NVL, 95830 MiB", "h100-nvl-94gb", 93.58),
    ("NVIDIA H200, 143771 MiB", "h200-141gb", 140.4),
    ("NVIDIA GH200 480GB, 97871 MiB", "gh200-96gb", 95.58),
    ("NVIDIA GH200 144G HBM3e, 146831 MiB", "gh200-144gb", 143.39),
    ("NVIDIA B200, 183359 MiB", "b200-180gb", 179.06),
    ("NVIDIA L40S, 46068 MiB", "l40s-48gb", 44.99),
    ("NVIDIA A10G, 23028 MiB", "a10g-24gb", 22.49),
    ("Tesla V100-SXM2-16GB, 16384 MiB", "v100-sxm2", 16.0),
    ("Tesla V100-SXM2-32GB, 32510 MiB", "v100-sxm2", 31.75),
    ("Tesla V100-PCIE-32GB, 32768 MiB", "v100-pcie", 32.0),
    ("Tesla V100-SXM3-32GB, 32768", "v100-sxm3", 32.0),       # a DGX-2's, no units (a fixture's CSV)
]
# names no kind describes (or a known name with a memory no kind of it has)
UNKNOWN = ["NVIDIA RTX A6000, 49140 MiB", "NVIDIA A800-SXM4-80GB, 81920 MiB",
           "NVIDIA H100 PCIe, 61440 MiB", "NVIDIA GeForce RTX 4090, 24564 MiB"]

TOPO_H200 = """\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\t0-63,128-191\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\t0-63,128-191\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\t0-63,128-191\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\t0-63,128-191\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\t64-127,192-255\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\t64-127,192-255\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t64-127,192-255\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\t64-127,192-255\t1\t\tN/A
NIC0\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE
NIC1\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_PCIE = """\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPHB\tSYS\tSYS\t0-11,24-35\t0\t\tN/A
GPU1\tPHB\t X \tSYS\tSYS\t0-11,24-35\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tPHB\t12-23,36-47\t1\t\tN/A
GPU3\tSYS\tSYS\tPHB\t X \t12-23,36-47\t1\t\tN/A

Legend:

  X    = Self
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
"""
