#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512i a[12]; __m512i x=_mm512_set1_epi8(3), w=_mm512_set1_epi8(5);
  for(int i=0;i<12;i++) a[i]=_mm512_set1_epi32(i);
  long n=200000000; double t=now();
  for(long i=0;i<n;i++){
#define S(k) a[k]=_mm512_dpbusd_epi32(a[k],x,w);
    S(0)S(1)S(2)S(3)S(4)S(5)S(6)S(7)S(8)S(9)S(10)S(11)
    __asm__ volatile("" : "+v"(x));
  }
  double dt=now()-t; int s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_epi32(a[i]);
  printf("dpbusd zmm: %.2f G/s = %.1f GMAC/s (%d)\n", n*12/dt/1e9, n*12*64/dt/1e9, s);
  __m512 f[12]; __m512bh xb=(__m512bh)_mm512_set1_epi16(0x3f80), wb=xb;
  for(int i=0;i<12;i++) f[i]=_mm512_set1_ps(i);
  t=now();
  for(long i=0;i<n;i++){
#define B(k) f[k]=_mm512_dpbf16_ps(f[k],xb,wb);
    B(0)B(1)B(2)B(3)B(4)B(5)B(6)B(7)B(8)B(9)B(10)B(11)
    __asm__ volatile("" : "+v"(xb));
  }
  dt=now()-t; float fs=0; for(int i=0;i<12;i++) fs+=_mm512_reduce_add_ps(f[i]);
  printf("dpbf16 zmm: %.2f G/s = %.1f GMAC/s (%f)\n", n*12/dt/1e9, n*12*32/dt/1e9, fs);
}
