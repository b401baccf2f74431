"""Independent numpy rendition of docs/specs/nvfp4.md, one block at a time.

Written separately from kernels/nvfp4_math.h (value tables by enumeration, nearest-even by
search, numpy float32 scalar arithmetic) to derive and cross-check golden values: the expected
bytes of tests/kernels_cpu/mode_separation_test.cc come from here, and 27000 random
block x mode cases (with NaN, inf and underflowing scales) agree with the C++ reference.
Slow; for deriving test data, not for production. Run with /usr/bin/python3 (Debian numpy).

  from nvfp4_spec import *
  sf, codes = std_block(x16, amax)                          # standard NVFP4
  sf, codes, err4, err6 = fos_block(x16, amax, 448, 'mse', 'exact')   # 4over6
  pack(codes); decode(sf, codes, amax, E)
"""
import numpy as np
f32=np.float32
FLT_MAX=np.finfo(np.float32).max
def bits(x): return int(np.array(x,dtype=np.float32).view(np.uint32))
def fbits(u): return np.array(u,dtype=np.uint32).view(np.float32)[()]
ONE6=fbits(0x3E2AAAAB)
E4=[]
for c in range(256):
    e=(c>>3)&15; m=c&7; s=-1 if c&0x80 else 1
    if e==15 and m==7: E4.append(np.nan)
    elif e==0: E4.append(s*m*2.0**-9)
    else: E4.append(s*(8+m)*2.0**(e-10))
POS=[(E4[c],c) for c in range(0x7F)]
def e4m3(x):
    x=float(x)
    if np.isnan(x): return 0x7F
    sgn=0x80 if np.signbit(x) else 0
    a=abs(x)
    if a>=448: return sgn|0x7E
    best=None
    for v,c in POS:
        d=abs(v-a)
        if best is None or d<best[0] or (d==best[0] and (c&1)==0): best=(d,c)
    return sgn|best[1]
E2=[0,0.5,1,1.5,2,3,4,6]
def e2m1(x):
    x=float(x)
    if np.isnan(x): return 7
    sgn=8 if np.signbit(x) else 0
    a=min(abs(x),12.0); best=None
    for c,v in enumerate(E2):
        d=abs(v-a)
        if best is None or d<best[0] or (d==best[0] and (c&1)==0): best=(d,c)
    return sgn|best[1]
def e2val(c): return f32(-E2[c&7] if c&8 else E2[c&7]) if not (c==8) else f32(-0.0)
def fmin(a,b):
    if np.isnan(a): return b
    if np.isnan(b): return a
    return min(a,b)
def scales(amax,E):
    with np.errstate(all='ignore'):
        s=f32(f32(E)*f32(6))/f32(amax)
        if not np.isnan(s): s=min(s,FLT_MAX)
        s=f32(1) if s==0 else f32(s)
        return s, f32(f32(1)/s)
def bmax_of(x):
    m=f32(0)
    for v in x:
        a=abs(f32(v))
        if a>m: m=a
    return m
def std_block(x,amax):
    with np.errstate(all='ignore'):
        senc,sdec=scales(amax,448)
        mult=f32(senc*ONE6)
        s=fmin(f32(bmax_of(x)*mult),FLT_MAX)
        sf=e4m3(s)
        inv=fmin(f32(f32(1)/f32(f32(E4[sf])*sdec)),FLT_MAX)
        q=[e2m1(f32(f32(v)*inv)) for v in x]
        return sf,q
def f16r(x): return f32(np.float16(x))
def cand(x,sf,amax,E,metric,kind):
    with np.errstate(all='ignore'):
        senc,sdec=scales(amax,E)
        sff=f32(E4[sf])
        inv=fmin(f32(f32(1)/f32(sff*sdec)),FLT_MAX)
        err=f32(0); q=[]
        for v in x:
            v=f32(v); c=e2m1(f32(v*inv)); q.append(c)
            qs=f32(e2val(c)*sff)
            if kind=='exact': d=f32(f32(f32(qs*f32(amax))/f32(6*E))-v)
            else: d=f32(f16r(qs)-f32(v*senc))
            err=f32(err+(abs(d) if metric=='mae' else f32(d*d)))
        return err,q
def fos_block(x,amax,E,metric,kind):
    with np.errstate(all='ignore'):
        senc,sdec=scales(amax,E)
        base=f32(f32(bmax_of(x)/f32(6))*senc)
        s6=e4m3(fmin(base,f32(448))); s4=e4m3(fmin(f32(base*f32(1.5)),f32(448)))
        e6,q6=cand(x,s6,amax,E,metric,kind); e4,q4=cand(x,s4,amax,E,metric,kind)
        return (s4,q4,e4,e6) if e4<e6 else (s6,q6,e4,e6)
def pack(q): return [ (q[2*i]&15)|((q[2*i+1]&15)<<4) for i in range(len(q)//2)]
def decode(sf,q,amax,E):
    inv6e=f32(f32(1)/f32(6*E))
    with np.errstate(all='ignore'):
        fin=f32(f32(f32(E4[sf])*f32(amax))*inv6e)
        return [f32(e2val(c)*fin) for c in q]
