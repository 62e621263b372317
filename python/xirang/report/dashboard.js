(function(){
"use strict";
var status=document.getElementById('xirang-status');
window.addEventListener('error',function(e){status.setAttribute('data-state','error');
  status.textContent='script error: '+e.message;});
var D=JSON.parse(document.getElementById('xirang-data').textContent);
var A=D.analysis, NS='http://www.w3.org/2000/svg', charts=0;
var PAL=['#4e79a7','#f28e2b','#e15759','#76b7b2','#59a14f','#edc948','#b07aa1','#ff9da7','#9c755f','#bab0ac'];
function el(tag,attrs,parent){var e=document.createElementNS(NS,tag);
  for(var k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function fmtS(v){var a=Math.abs(v);if(a>=1)return v.toFixed(2)+' s';if(a>=1e-3)return (v*1e3).toFixed(2)+' ms';return (v*1e6).toFixed(1)+' us';}
function fmtB(v){var u=[['GB',1e9],['MB',1e6],['kB',1e3]];for(var i=0;i<u.length;i++)if(v>=u[i][1])return (v/u[i][1]).toFixed(2)+' '+u[i][0];return v.toFixed(0)+' B';}
function nice(m){if(!(m>0))return 1;var p=Math.pow(10,Math.floor(Math.log10(m))),f=m/p;return (f<=1?1:f<=2?2:f<=5?5:10)*p;}
/* bar chart: o={title,cats,series:[{name,values,color}],stacked,highlight,fmt,ylabel} */
function bars(id,o){
  var host=document.getElementById(id);host.innerHTML='';
  var W=1000,H=300,ml=70,mr=160,mt=24,mb=50,pw=W-ml-mr,ph=H-mt-mb,n=o.cats.length;
  var svg=el('svg',{width:W,height:H,viewBox:'0 0 '+W+' '+H,role:'img'},host);
  el('text',{x:ml,y:14,'font-weight':'bold'},svg).textContent=o.title;
  var max=0;for(var i=0;i<n;i++){var s=0;o.series.forEach(function(se){var v=se.values[i]||0;s=o.stacked?s+v:Math.max(s,v);});max=Math.max(max,s);}
  max=nice(max*1.05);var fmt=o.fmt||fmtS;
  for(var t=0;t<=4;t++){var y=mt+ph-ph*t/4;el('line',{x1:ml,x2:ml+pw,y1:y,y2:y,stroke:'#e4e4e4'},svg);
    el('text',{x:ml-4,y:y+4,'text-anchor':'end'},svg).textContent=fmt(max*t/4);}
  if(o.ylabel){var yl=el('text',{x:12,y:mt+ph/2,transform:'rotate(-90 12 '+(mt+ph/2)+')','text-anchor':'middle'},svg);yl.textContent=o.ylabel;}
  var bw=pw/Math.max(1,n),ns=o.series.length,every=Math.max(1,Math.ceil(n/25));
  for(var i=0;i<n;i++){
    var x0=ml+i*bw,base=0;
    o.series.forEach(function(se,j){var v=se.values[i]||0;var h=v/max*ph;
      var x=o.stacked?x0+bw*0.1:x0+bw*0.1+j*bw*0.8/ns,w=o.stacked?bw*0.8:bw*0.8/ns;
      var y=mt+ph-(o.stacked?base+h:h);
      var r=el('rect',{x:x,y:y,width:Math.max(w,0.5),height:Math.max(h,0),fill:se.colors?se.colors[i]:se.color},svg);
      el('title',{},r).textContent=o.cats[i]+' / '+se.name+': '+fmt(v);
      if(o.stacked)base+=h;});
    if(o.highlight===i){el('rect',{x:x0+1,y:mt,width:bw-2,height:ph,fill:'none',stroke:'#d00','stroke-width':2},svg);
      el('text',{x:x0+bw/2,y:mt-3,'text-anchor':'middle',fill:'#d00'},svg).textContent='slowest';}
    if(i%every===0){var lx=x0+bw/2,ly=mt+ph+14;var tx=el('text',{x:lx,y:ly,'text-anchor':n>12?'end':'middle',transform:n>12?'rotate(-35 '+lx+' '+ly+')':''},svg);tx.textContent=o.cats[i];}
  }
  el('line',{x1:ml,x2:ml+pw,y1:mt+ph,y2:mt+ph,stroke:'#888'},svg);
  o.series.forEach(function(se,j){var y=mt+j*16;el('rect',{x:ml+pw+10,y:y,width:10,height:10,fill:se.color},svg);
    el('text',{x:ml+pw+24,y:y+9},svg).textContent=se.name;});
  charts++;
}
function table(id,head,rows,slowIdx){
  var t=document.getElementById(id),h='<tr>'+head.map(function(x){return '<th>'+x+'</th>';}).join('')+'</tr>';
  rows.forEach(function(r,i){h+='<tr'+(i===slowIdx?' class="slow"':'')+'>'+r.map(function(c,j){return '<td'+(j===0?' class="l"':'')+'>'+String(c).replace(/&/g,'&amp;').replace(/</g,'&lt;')+'</td>';}).join('')+'</tr>';});
  t.innerHTML=h;
}
var steps=[];for(var s=0;s<A.steps;s++)steps.push((A.mode==='hook'?'step ':'op ')+s);
var PH=A.phases;
function phaseChart(){
  var k=document.getElementById('group-select').value;
  var g=A.groups.filter(function(x){return x.key===k;})[0];if(!g)return;
  bars('c-phases',{title:'phase breakdown per step: '+g.key+(g.label?' ('+g.label+')':'')+' (mean over ranks)',
    cats:steps,stacked:true,ylabel:'seconds',
    series:PH.map(function(p,j){return {name:p.replace(/_s$/,''),values:g.per_step[p],color:PAL[j]};})});
}
var sel=document.getElementById('group-select');
A.groups.forEach(function(g){var o=document.createElement('option');o.value=g.key;o.textContent=g.key+(g.label?' ('+g.label+')':'');
  if(g.key===A.hottest_group)o.selected=true;sel.appendChild(o);});
sel.addEventListener('change',phaseChart);
phaseChart();
bars('c-share',{title:"each group's busy time per step (stack = step's communication time)",cats:steps,stacked:true,ylabel:'seconds',
  series:A.groups.map(function(g,j){return {name:g.key,values:g.per_step.total_s,color:PAL[j%PAL.length]};})});
table('t-groups',['group','layers','busy','share','raw bytes','wire bytes','wire/raw'].concat(PH.map(function(p){return p.replace(/_s$/,'');})),
  A.groups.map(function(g){return [g.key+(g.key===A.hottest_group?' (hottest)':''),g.label,fmtS(g.busy_s),(100*g.share).toFixed(1)+'%',fmtB(g.bytes_raw),fmtB(g.bytes_wire),
    g.bytes_raw?(g.bytes_wire/g.bytes_raw).toFixed(3):'-'].concat(PH.map(function(p){return fmtS(g.phase_s[p]);}));}),
  A.groups.map(function(g){return g.key;}).indexOf(A.hottest_group));
bars('c-bytes',{title:'bytes per group, all ranks: raw vs on the wire',cats:A.groups.map(function(g){return g.key;}),fmt:fmtB,ylabel:'bytes',
  series:[{name:'raw',values:A.groups.map(function(g){return g.bytes_raw;}),color:PAL[0]},
          {name:'on the wire',values:A.groups.map(function(g){return g.bytes_wire;}),color:PAL[1]}]});
bars('c-exposed',{title:'hidden vs exposed communication per step (mean over ranks; '+A.exposure.source+')',cats:steps,stacked:true,ylabel:'seconds',
  series:[{name:'exposed',values:A.exposure.exposed_s,color:PAL[2]},{name:'hidden',values:A.exposure.hidden_s,color:PAL[4]}]});
var rk=A.ranks.map(function(r){return r.rank;}),si=rk.indexOf(A.slowest_rank);
bars('c-ranks',{title:'net wait introduced per rank (receivers waiting on it - it waiting on senders)',cats:rk.map(function(r){return 'rank '+r;}),
  highlight:si<0?null:si,ylabel:'seconds',
  series:[{name:'net wait introduced',values:A.ranks.map(function(r){return Math.max(0,r.net_wait_introduced_s);}),color:PAL[2],
           colors:A.ranks.map(function(r,i){return i===si?'#d00':PAL[0];})},
          {name:'waited on senders',values:A.ranks.map(function(r){return r.waited_s;}),color:PAL[5]}]});
table('t-ranks',['rank','ops','busy','queued','unattributed','waited on senders','receivers waited on it','net wait introduced','bytes sent'],
  A.ranks.map(function(r){return ['rank '+r.rank+(r.rank===A.slowest_rank?' (slowest)':''),r.ops,fmtS(r.busy_s),fmtS(r.queued_s),fmtS(r.unattributed_s),fmtS(r.waited_s),fmtS(r.induced_s),fmtS(r.net_wait_introduced_s),fmtB(r.bytes_wire)];}),si<0?null:si);
var lk=A.links.map(function(l){return l.src+' -> '+l.dst;}),li=-1;
A.links.forEach(function(l,i){if(A.slowest_link&&l.src===A.slowest_link[0]&&l.dst===A.slowest_link[1])li=i;});
bars('c-links',{title:"per link (sender -> receiver): transfer time / the same operations' median link",cats:lk,highlight:li<0?null:li,ylabel:'x median',
  fmt:function(v){return v.toFixed(2)+'x';},
  series:[{name:'slowness',values:A.links.map(function(l){return l.slowness||0;}),color:PAL[0],
           colors:A.links.map(function(l,i){return i===li?'#d00':PAL[0];})}]});
table('t-links',['link','ops','bytes','sender send time','receiver recv time','transfer (min)','x median','throughput'],
  A.links.map(function(l){return [l.src+' -> '+l.dst+(A.links.indexOf(l)===li?' (slowest)':''),l.ops,fmtB(l.bytes),fmtS(l.send_s),fmtS(l.recv_wait_s),fmtS(l.transfer_s),
    l.slowness?l.slowness.toFixed(2)+'x':'-',l.throughput_Bps?(l.throughput_Bps/1e9).toFixed(3)+' GB/s':'-'];}),li<0?null:li);
status.setAttribute('data-state','ok');status.setAttribute('data-charts',String(charts));
status.textContent='rendered '+charts+' charts from '+D.records_total+' records';
})();
