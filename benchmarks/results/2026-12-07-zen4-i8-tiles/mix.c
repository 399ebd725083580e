#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512i a[8]; __m512i x=_mm512_set1_epi8(3), w=_mm512_set1_epi8(5), m=_mm512_set1_epi8(15);
  __m512 f[4]; __m512 g=_mm512_set1_ps(1.0001f);
  for(int i=0;i<8;i++) a[i]=_mm512_set1_epi32(i);
  for(int i=0;i<4;i++) f[i]=_mm512_set1_ps(i);
  long n=100000000;
  for (int variant=0; variant<5; variant++){
  double t=now();
  for(long i=0;i<n;i++){
#define S(k) a[k]=_mm512_dpbusd_epi32(a[k],x,w);
    S(0)S(1)S(2)S(3)S(4)S(5)S(6)S(7)
    if (variant==1){ f[0]=_mm512_fmadd_ps(f[0],g,g); f[1]=_mm512_fmadd_ps(f[1],g,g); f[2]=_mm512_fmadd_ps(f[2],g,g); f[3]=_mm512_fmadd_ps(f[3],g,g);}
    if (variant==2){ __m512i u=_mm512_and_si512(w,m), v=_mm512_and_si512(_mm512_srli_epi16(w,4),m); __asm__ volatile("" :: "v"(u),"v"(v)); }
    if (variant==3){ f[0]=_mm512_cvtepi32_ps(a[0]); f[1]=_mm512_mul_ps(f[1],g); f[2]=_mm512_cvtepi32_ps(a[2]); f[3]=_mm512_mul_ps(f[3],g);}
    if (variant==4){ f[0]=_mm512_fmadd_ps(f[0],g,g); f[1]=_mm512_fmadd_ps(f[1],g,g); f[2]=_mm512_cvtepi32_ps(a[2]); f[3]=_mm512_mul_ps(f[3],g);
       __m512i u=_mm512_and_si512(w,m), v=_mm512_and_si512(_mm512_srli_epi16(w,4),m); __asm__ volatile("" :: "v"(u),"v"(v)); }
    __asm__ volatile("" : "+v"(x), "+v"(w), "+v"(g));
  }
  double dt=now()-t; int s=0; for(int i=0;i<8;i++) s+=_mm512_reduce_add_epi32(a[i]); float fs=0; for(int i=0;i<4;i++) fs+=_mm512_reduce_add_ps(f[i]);
  printf("variant %d: %.2f ns/iter (8 dpbusd), %.2f cycles at 3.6GHz (%d %f)\n", variant, dt/n*1e9, dt/n*3.6e9, s, fs);
  }
}
