#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define RUN(K) { __m512i a[K]; for(int i=0;i<K;i++) a[i]=_mm512_set1_epi32(i); double t=now(); \
  for(long i=0;i<n;i++){ for(int k=0;k<K;k++) a[k]=_mm512_dpbusd_epi32(a[k],x,w); __asm__ volatile("" : "+v"(x), "+v"(w)); } \
  double dt=now()-t; int s=0; for(int i=0;i<K;i++) s+=_mm512_reduce_add_epi32(a[i]); \
  printf("%2d chains: %.2f cycles per dpbusd (%d)\n", K, dt/n/K*3.6e9, s); }
int main(){ __m512i x=_mm512_set1_epi8(3), w=_mm512_set1_epi8(5); long n=50000000;
  RUN(1) RUN(2) RUN(4) RUN(6) RUN(8) RUN(10) RUN(12) RUN(16) }
