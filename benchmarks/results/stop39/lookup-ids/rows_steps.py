"""Stop 39: the row-sparse exchange's local steps on DLRM's 26 tables, one thread, one process
(the flag pass `_touched`, packing, the union, the gather and scatter): ms per call."""
import time, torch
torch.set_num_threads(1)
from scaleout.compression import rows as R
TABLES = [(20000, 16), (10000, 16), (5000, 16), (2000, 16), (1000, 16), (500, 16), (200, 16),
          (100, 16), (50, 16), (20, 16), (10, 16), (5, 16), (3, 16)] * 2
numel=sum(r*w for r,w in TABLES)
g=torch.Generator().manual_seed(0)
flat=torch.zeros(numel); off=0
for r,w in TABLES:
    t=flat[off:off+r*w].view(r,w); off+=r*w
    t[torch.randint(0,r,(256,),generator=g)]=torch.randn(256,w,generator=g)
src=flat.clone()
scratch=torch.empty(numel)
def T(name,f,n=200):
    for _ in range(10): f()
    t=time.perf_counter()
    for _ in range(n): out=f()
    print(f"{name:30s} {(time.perf_counter()-t)/n*1e3:.3f} ms"); return out
T("copy bucket 5MB", lambda: flat.copy_(src))
flags=T("touched (abs+mv)", lambda: R._touched(flat.view(-1,16), scratch.view(-1,16)))
bits=T("packed", lambda: R._packed(flags))
every=bits.repeat(2)
union=T("unpacked", lambda: R._unpacked(every.view(2,-1), flags.numel()))
sent=T("nonzero", lambda: union.nonzero().view(-1))
print('rows sent', sent.numel(), 'of', union.numel())
piece=T("index_select", lambda: flat.view(-1,16).index_select(0,sent).view(-1))
cat=T("cat", lambda: torch.cat([piece]))
T("index_copy_", lambda: flat.view(-1,16).index_copy_(0,sent,piece.view(-1,16)))
T("abs only", lambda: torch.abs(flat, out=scratch))
T("mv only", lambda: torch.mv(scratch.view(-1,16), scratch.new_ones(16)))
T("view(-1,16).ne(0).any(1)", lambda: flat.view(-1,16).ne(0).any(1))
T("amax(1)", lambda: scratch.view(-1,16).amax(1))
T("count_nonzero(1)", lambda: torch.count_nonzero(flat.view(-1,16),dim=1))
