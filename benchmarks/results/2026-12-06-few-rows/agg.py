import sys, collections, re
c=collections.Counter(); t=collections.Counter()
for line in sys.stdin:
    m = re.match(r'\s*(\d+)\s+[0-9a-f]+\s+(.*) \((.*)\)\s*$', line)
    if not m: continue
    tid, sym, dso = m.groups(); dso = dso.split('/')[-1]
    if 'tercet' in dso:
        key = re.sub(r'\(anonymous namespace\)::', '', sym)[:70]
    else:
        key = dso
    c[(tid,key)]+=1; t[tid]+=1
tot = sum(t.values())
for tid in t:
    print(tid, '%.1f%% of samples' % (100*t[tid]/tot))
    for (ti,k),v in c.most_common():
        if ti==tid and v/t[tid]>0.004: print('   %5.1f%% %s'%(100*v/t[tid],k))
